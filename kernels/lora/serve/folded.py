"""A projection group's LoRA bypass between its folded GEMM and its expand (`FoldedLoRA`).

A merged projection group (q/k/v, o, gate/up or down) keeps, below its base weight rows, the LoRA
A rows of every slot, so one GEMM gives the base outputs and every slot's shrink
(`MergedProjection.fold_lora` in flexserve.model.llama). What remains of the bypass is the expand,
y += scaling * s B^T per token's slot: `expand_bypass` runs it alone (parallel over tokens and
output tiles), and the SiLU-and-mul kernel fuses the gate/up pair's into the pass it makes over
them anyway. (An RMSNorm with the o/down expand fused in was measured slower on an H200: one
program per row streams that row's whole B alone; a decode step with adapters at batch 1 cost
2.2 ms over the base with it, against about 0.6 ms with separate expand launches.)
Plain torch here (no Triton import), so the model can build one on any machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_PROJECTIONS = 3
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, slots=True)
class FoldedLoRA:
    """A group's LoRA bypass after the folded GEMM and before its expand: what `lora_expand_folded`,
    or a consumer kernel that fuses the expand (SiLU-and-mul), needs to add it."""

    s: torch.Tensor  # [T, P * num_slots * max_rank]: the GEMM's shrink columns
    lora_b: torch.Tensor  # [num_slots, sum(sizes), max_rank]: the projections' B side by side
    scaling: torch.Tensor  # [P, num_slots] float32
    token_slots: torch.Tensor  # [T] int32/int64: each token's adapter slot, -1 = none
    sizes: tuple[int, ...]  # the projections' output widths, in column order

    def check(self, num_rows: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        """ValueError unless this bypass fits a [num_rows, width] base output (fusing launchers)."""
        check_bypass(self.s, self.lora_b, self.scaling, self.token_slots, self.sizes, num_rows, width, dtype,
                     device)

    def kernel_args(self) -> tuple:
        """(s, lora_b, scaling, token_slots, end0, end1, num_slots, max_rank, stride_sm,
        stride_bs, stride_bn) as `folded_lora_delta`'s callers take them."""
        num_slots, _, max_rank = self.lora_b.shape
        end0, end1 = projection_ends(self.sizes)
        return (self.s, self.lora_b, self.scaling, self.token_slots, end0, end1, num_slots, max_rank,
                self.s.stride(0), self.lora_b.stride(0), self.lora_b.stride(1))

    @property
    def rank_pad(self) -> int:
        return 1 << (self.lora_b.shape[2] - 1).bit_length()


def projection_ends(sizes: Sequence[int]) -> list[int]:
    """The kernels' (end0, end1): where projections 0 and 1 end; the total width past the last."""
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return (ends + [ends[-1]] * MAX_PROJECTIONS)[:2]


def check_bypass(
    s: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, token_slots: torch.Tensor,
    sizes: Sequence[int], num_rows: int, width: int, dtype: torch.dtype, device: torch.device,
) -> None:
    """Raise ValueError unless (s, lora_b, scaling, token_slots, sizes) is a folded bypass of a
    [num_rows, width] output of `dtype` on `device`."""
    if s.dim() != 2 or lora_b.dim() != 3 or scaling.dim() != 2:
        raise ValueError(f"a folded LoRA bypass is s [T, P * num_slots * max_rank], lora_b [num_slots, out, "
                         f"max_rank] and scaling [P, num_slots], got s {tuple(s.shape)}, lora_b "
                         f"{tuple(lora_b.shape)}, scaling {tuple(scaling.shape)}")
    if not 1 <= len(sizes) <= MAX_PROJECTIONS or any(n <= 0 for n in sizes):
        raise ValueError(f"sizes must be 1 to {MAX_PROJECTIONS} positive projection widths, got {list(sizes)}")
    num_slots, out_size, max_rank = lora_b.shape
    num_proj = len(sizes)
    if num_slots == 0 or max_rank == 0:
        raise ValueError(f"lora_b {tuple(lora_b.shape)} has no slot or no rank")
    if sum(sizes) != out_size or width != out_size:
        raise ValueError(f"sizes {list(sizes)} (sum {sum(sizes)}), lora_b's {out_size} outputs and the output's "
                         f"{width} columns must agree")
    if tuple(scaling.shape) != (num_proj, num_slots):
        raise ValueError(f"scaling must be [{num_proj}, {num_slots}], got {tuple(scaling.shape)}")
    if tuple(s.shape) != (num_rows, num_proj * num_slots * max_rank):
        raise ValueError(f"s must be [{num_rows}, {num_proj * num_slots * max_rank}] (T, projections x slots x "
                         f"max_rank), got {tuple(s.shape)}")
    if token_slots.dim() != 1 or token_slots.shape[0] != num_rows:
        raise ValueError(f"token_slots must be [T] for {num_rows} rows, got {tuple(token_slots.shape)}")
    if token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be int32 or int64, got {token_slots.dtype}")
    if dtype not in _DTYPES or s.dtype != dtype or lora_b.dtype != dtype:
        raise ValueError(f"s, lora_b and the output must share one dtype of {_DTYPES}, got {s.dtype}, "
                         f"{lora_b.dtype}, {dtype}")
    if scaling.dtype != torch.float32:
        raise ValueError(f"scaling must be float32, got {scaling.dtype}")
    if not scaling.is_contiguous():
        raise ValueError(f"scaling must be contiguous, got strides {scaling.stride()}")
    for name, t in (("s", s), ("lora_b", lora_b), ("token_slots", token_slots), ("scaling", scaling)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the output is on {device}")

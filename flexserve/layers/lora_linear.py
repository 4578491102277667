"""A frozen backbone linear plus a batched LoRA bypass: every token adds its own adapter's delta.

    y = x W^T + b                                 one GEMM for all tokens of the step
    s = shrink(x, A[slot(t)])                     [T, max_rank]; tokens without adapter: skipped
    y += scaling[slot(t)] * s B[slot(t)]^T        in place, per same-slot segment

Adapters live in `max_loras` device slots of width `max_rank` (rank r < max_rank is zero-padded,
which adds exact zeros). Which slot each token uses comes from the step's `LoRAKernelMeta`, built
once by the model runner and read here from the forward context. A step whose tokens all use the
base model runs only the GEMM.

On the GPU path a projection group (`flexserve.model.llama.MergedProjection`: q/k/v, o, gate/up,
down) of a prefill-sized batch runs as LoRAFusion's kernels instead (`lora_group_forward`):
kernel 1 for each shrink, kernel 2's term written into the output, and the frozen GEMM adding
x W^T to it as its C operand, so the output is written once and read once by the GEMM rather
than written by the GEMM and read and written again by the expand.

While a fine-tuning forward window is in the batch (a `FinetuneCapture` in the forward context),
the capture runs the shrink (`FinetuneCapture.lora_shrink`): its rows get LoRA dropout on the
shrink input, hashed in registers by fused LoRA kernel 1 on the GPU, and their `{target}_base`,
`{target}_xd` (where a plan keeps it) and `{target}_s` tensors (`flexserve.peft.layer_graph`
names) go to the capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flexserve.layers.forward_context import get_forward_context
from flexserve_kernels.dispatch import use_triton
from flexserve_kernels.lora.serve.cuda_ext import cuda_decode_replaces_fused
from flexserve_kernels.lora.serve.ops import (
    BGMV_MAX_TOKENS,
    fuses_batch,
    lora_expand,
    lora_linear_term,
    lora_shrink,
    lora_shrink_fused,
)

# Projections whose decode-sized batches take the fused shrink+expand kernel. down_proj stays on
# the BGMV pair: its shrink reads a 14336-wide A, which the fused kernel would re-read per output
# tile (H200, Llama-3.1-8B shapes, rank 16, benchmarks/lora_fused_kernel.py: per layer 31.3 us
# with down on BGMV vs 35.1 us all fused at batch 16). Unless down's shrinks are folded into its
# GEMM, that pair runs on the CUDA C++ extension for decode batches of up to
# cuda_ext.CUDA_DECODE_MAX_ROWS tokens under the default FLEXSERVE_LORA_DECODE_BACKEND=auto
# (lora_shrink / lora_expand decide).
_FUSED_DECODE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")


class LoRALinear(nn.Module):
    """Replaces an `nn.Linear`, sharing its `weight` and `bias` Parameters (same names, so
    checkpoints load unchanged), and adds slot-stacked LoRA weights as non-persistent buffers."""

    def __init__(
        self, base: nn.Linear, max_loras: int, max_rank: int, layer_idx: int = -1, target: str = ""
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # decoder layer and target name (q_proj, ...): where a
        self.target = target  # fine-tuning capture files this linear's tensors
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        device, dtype = base.weight.device, base.weight.dtype
        # Layouts of the kernels' contract: A [slots, max_rank, in], B [slots, out, max_rank].
        self.register_buffer("lora_a", torch.zeros(
            max_loras, max_rank, self.in_features, device=device, dtype=dtype), persistent=False)
        self.register_buffer("lora_b", torch.zeros(
            max_loras, self.out_features, max_rank, device=device, dtype=dtype), persistent=False)
        self.register_buffer("scaling", torch.zeros(
            max_loras, device=device, dtype=torch.float32), persistent=False)
        # Slots holding weights for this linear (host side): an adapter or fine-tuning job that
        # does not target it leaves its slot zero here, and a batch using only such slots skips
        # this linear's LoRA kernels (H200, Llama-3.1-8B, a down_proj-only job: 7 of 8 LoRA
        # launches of a fine-tuning window were for zero slots, ~25 ms of host time per window).
        self.active_slots: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        y = F.linear(x, self.weight, self.bias)
        context = get_forward_context()
        meta = context.lora_meta
        if meta is None or not meta.has_lora:
            return y
        if context.finetune is None:
            add_lora((self,), x, (y,), meta)
            return y
        self.add_captured_bypass(x, y, meta, context.finetune)
        return y

    def add_captured_bypass(self, x: torch.Tensor, y: torch.Tensor, meta, capture) -> None:
        """Add the bypass of x into y, this linear's base output [T, out] (a column slice of a
        merged GEMM's output is fine), in place, handing `{target}_base`, `{target}_xd` and
        `{target}_s` of the fine-tuning rows to `capture` (a `FinetuneCapture`) on the way."""
        if meta is None or not meta.has_lora:
            return
        if not self.has_weights_for(meta):
            capture.take(self.layer_idx, f"{self.target}_base", y)
            return
        capture.take(self.layer_idx, f"{self.target}_base", y)  # before the expand adds into y
        s = capture.lora_shrink(self, x, meta)  # dropout on the fine-tuning rows
        capture.take_lora_shrink(self, s)
        lora_expand(s, self.lora_b, meta, y, self.scaling)

    @torch.no_grad()
    def set_slot(
        self, slot: int, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None,
        scaling: float = 0.0,
    ) -> None:
        """Copy one adapter's A [r, in] and B [out, r] into `slot`; None clears it (no bypass)."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is out of range [0, {self.max_loras})")
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if lora_a is None or lora_b is None:
            self.scaling[slot] = 0.0
            self.active_slots.discard(slot)
            return
        rank = lora_a.shape[0]
        if (
            rank > self.max_rank
            or tuple(lora_a.shape) != (rank, self.in_features)
            or tuple(lora_b.shape) != (self.out_features, rank)
        ):
            raise ValueError(
                f"LoRA weights A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} do not fit a "
                f"{self.in_features} -> {self.out_features} linear with max rank {self.max_rank}"
            )
        self.lora_a[slot, :rank].copy_(lora_a, non_blocking=True)
        self.lora_b[slot, :, :rank].copy_(lora_b, non_blocking=True)
        self.scaling[slot] = scaling
        self.active_slots.add(slot)

    def has_weights_for(self, meta) -> bool:
        """Whether any slot of the batch holds weights for this linear (True when unknown)."""
        return meta.slots is None or not self.active_slots.isdisjoint(meta.slots)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, max_loras={self.max_loras}, max_rank={self.max_rank}"
        )


def add_lora(modules: tuple[nn.Module, ...], x: torch.Tensor, outputs: tuple[torch.Tensor, ...],
             meta=None) -> None:
    """Add each `LoRALinear`'s bypass of x into its output (in place; outputs may be column
    slices of one merged GEMM's output). Plain `nn.Linear`s (LoRA off) add nothing.

    Decode-sized batches on the Triton path run one fused shrink+expand launch for all the given
    projections (`flexserve_kernels.lora.serve.fused`) when they are all fused targets; other batches
    and projections the SGMV/BGMV pair per projection, whose decode-only BGMV `lora_shrink` /
    `lora_expand` may send to the CUDA extension (FLEXSERVE_LORA_DECODE_BACKEND).
    """
    if not isinstance(modules[0], LoRALinear):
        return
    if meta is None:
        meta = get_forward_context().lora_meta
    if meta is None or not meta.has_lora:
        return
    active = [(m, y) for m, y in zip(modules, outputs) if m.has_weights_for(meta)]
    if not active:
        return
    modules, outputs = tuple(m for m, _ in active), tuple(y for _, y in active)
    if folds_batch(x, meta) and all(m.target in _FUSED_DECODE_TARGETS for m in modules):
        from flexserve_kernels.lora.serve.fused import lora_fused_bgmv

        lora_fused_bgmv(x, [(m.lora_a, m.lora_b, m.scaling, y) for m, y in zip(modules, outputs)],
                        meta.token_slots)
        return
    for module, y in zip(modules, outputs):
        lora_expand(lora_shrink(x, module.lora_a, meta), module.lora_b, meta, y, module.scaling)


def lora_group_forward(modules: tuple[nn.Module, ...], x: torch.Tensor, weight: torch.Tensor, meta,
                       capture=None) -> torch.Tensor | None:
    """y [T, sum(out)] = x W^T plus each projection's LoRA bypass in its column slice, W the
    group's weight rows (the projections' weights stacked), as LoRAFusion's kernels: per
    projection kernel 1's shrink (dropout through `capture`, a `FinetuneCapture`, which also takes
    `{target}_s`) and kernel 2's term written into its slice, then one GEMM adding x W^T with y as
    its C operand. None where the SGMV/BGMV path runs instead (`fuses_batch`, no adapter weights
    in the batch for the group, or a capture that keeps a `{target}_base`, which this path never
    holds apart): the caller then runs the GEMM and `add_lora` / `add_captured_bypass`."""
    if not isinstance(modules[0], LoRALinear) or meta is None or not fuses_batch(x, meta, modules[0].max_rank):
        return None
    active = [m.has_weights_for(meta) for m in modules]
    if not any(active):
        return None
    if capture is not None and any(capture.wants(m.layer_idx, f"{m.target}_base") for m in modules):
        return None
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    start = 0
    for module, has_weights in zip(modules, active):
        part = y[:, start:start + module.out_features]
        start += module.out_features
        if not has_weights:
            part.zero_()
            continue
        if capture is None:
            s = lora_shrink_fused(x, module.lora_a, meta)
        else:
            s = capture.lora_shrink(module, x, meta, fused=True)
            capture.take_lora_shrink(module, s)
        lora_linear_term(s, module.lora_b, meta, module.scaling, part)
    return y.addmm_(x, weight.t())


def folds_batch(x: torch.Tensor, meta) -> bool:
    """Whether a batch is decode-sized LoRA work for the Triton path: the fused shrink+expand
    kernel or, in a merged group with folded shrinks (`MergedProjection.fold_lora`), the folded
    GEMM and one expand. FLEXSERVE_LORA_DECODE_BACKEND=cuda sends decode-only batches to the CUDA
    BGMV pair instead (lora_shrink/lora_expand pick it); auto (the default) and triton keep them
    here (auto's CUDA pair is for the projections outside the fused groups: `add_lora`). Host
    flags and counts only, fixed per batch size (CUDA graphs)."""
    return (use_triton(x.device) and (meta.decode_only or meta.num_tokens <= BGMV_MAX_TOKENS)
            and not cuda_decode_replaces_fused(x.device, meta))

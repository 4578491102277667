"""SiLU-and-mul, the Llama MLP's silu(gate_proj(x)) * up_proj(x), in one pass over gate and up.

Takes gate and up as two tensors (flexserve's LlamaMLP has separate gate_proj and up_proj, each of
which the LoRA layers wrap), or one [T, 2*d] tensor whose halves are gate and up (a fused
gate_up projection). silu is computed in fp32 and rounded to the input dtype before the multiply,
as torch's F.silu(gate) * up does, so results match the eager path within one ulp (exp differs).

With `lora` (a `FoldedLoRA` of the gate/up pair, decode batches with adapters), the pair's LoRA
expand is fused in: gate and up get their bypass delta added and rounded, exactly as
`lora_expand_folded` would store them, before the activation; one launch instead of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flexserve_kernels.lora.serve.expand_folded import folded_lora_delta
from flexserve_kernels.lora.serve.folded import FoldedLoRA

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr, up_ptr, out_ptr,
    width,
    stride_g, stride_u, stride_o,
    s_ptr, b_ptr, scaling_ptr, token_slots_ptr, end0, end1, num_slots, max_rank,
    stride_sm, stride_bs, stride_bn,
    HAS_LORA: tl.constexpr, RANK_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    # Grid: (row, column tile).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    x_ty = gate_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_LORA:  # gate's columns are projection 0 of the folded pair, up's projection 1
        slot = tl.load(token_slots_ptr + row)
        s_row = s_ptr + row * stride_sm
        g = (g + folded_lora_delta(s_row, b_ptr, scaling_ptr, slot, cols, mask, end0, end1, num_slots,
                                   max_rank, stride_bs, stride_bn, 2, RANK_PAD)).to(x_ty).to(tl.float32)
        u = (u + folded_lora_delta(s_row, b_ptr, scaling_ptr, slot, cols + width, mask, end0, end1, num_slots,
                                   max_rank, stride_bs, stride_bn, 2, RANK_PAD)).to(x_ty).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(x_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    gate: torch.Tensor, up: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
    lora: FoldedLoRA | None = None,
) -> torch.Tensor:
    """silu(gate) * up for gate, up [T, d]; with up=None, gate is [T, 2*d] = [gate | up].

    Returns out [T, d] in the inputs' dtype (allocated unless given). Rows may be strided; the
    last dimension must be contiguous. CUDA-graph safe. `lora`: the gate/up pair's folded LoRA
    (sizes (d, d)), added to gate and up first (gate and up themselves are not written).
    """
    if up is None:
        if gate.dim() != 2 or gate.shape[1] % 2 != 0:
            raise ValueError(f"a fused gate_up input must be [T, 2*d], got {tuple(gate.shape)}")
        width = gate.shape[1] // 2
        gate, up = gate[:, :width], gate[:, width:]
    if gate.dim() != 2 or up.shape != gate.shape:
        raise ValueError(f"gate and up must both be [T, d], got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype not in _DTYPES or up.dtype != gate.dtype:
        raise ValueError(f"gate and up must share a dtype in {_DTYPES}, got {gate.dtype}, {up.dtype}")
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    elif out.shape != gate.shape or out.dtype != gate.dtype:
        raise ValueError(f"out must be {gate.dtype} {tuple(gate.shape)}, got {out.dtype} {tuple(out.shape)}")
    for name, t in (("gate", gate), ("up", up), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
        if t.device != gate.device:
            raise ValueError(f"{name} is on {t.device}, gate on {gate.device}")
    num_rows, width = gate.shape
    if lora is not None:
        if tuple(lora.sizes) != (width, width):
            raise ValueError(f"lora must be the gate/up pair's ({width}, {width}), got sizes {lora.sizes}")
        lora.check(num_rows, 2 * width, gate.dtype, gate.device)
        lora_args, rank_pad = lora.kernel_args(), lora.rank_pad
    else:
        lora_args, rank_pad = (None, None, None, None, 0, 0, 0, 0, 0, 0, 0), 1
    if num_rows > 0 and width > 0:
        # 1024 columns at 4 warps = 8 per thread (16 bytes of bf16): Llama-3.1-8B's 14336 -> 14
        # tiles. With LoRA, B tiles of [BLOCK, rank] for gate and up: 128 columns at rank 16 (256
        # spills registers in fp32 on sm_90).
        block = min(1024 if lora is None else max(16, 2048 // rank_pad), triton.next_power_of_2(width))
        _silu_and_mul_kernel[(num_rows, triton.cdiv(width, block))](
            gate, up, out, width, gate.stride(0), up.stride(0), out.stride(0), *lora_args,
            HAS_LORA=lora is not None, RANK_PAD=rank_pad, BLOCK=block, num_warps=4,
        )
    return out


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of `silu_and_mul`: F.silu(gate) * up, as LlamaMLP computes it."""
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up

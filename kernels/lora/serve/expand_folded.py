"""Decode LoRA expand after a folded shrink: the shrink rode in the base GEMM, this adds s B^T.

A projection group (q/k/v, o, gate/up or down) keeps, below its base weight rows, the LoRA A rows
of every slot: W_folded = [W_0; ...; W_{P-1}; A_0; ...; A_{P-1}] with A_p = lora_a_p viewed as
[num_slots * max_rank, in]. One GEMM x W_folded^T then gives the base outputs and every slot's
shrink s_p[t, slot * max_rank + j] = x[t] . lora_a_p[slot, j], and this kernel finishes the bypass:

    for t with slot = token_slots[t] >= 0, column n of projection p = proj(n):
        y[t, n] += scaling[p, slot] * sum_j s[t, p * num_slots * max_rank + slot * max_rank + j]
                                          * lora_b[slot, n, j]

y is the group's base output [T, out] (all projections side by side), lora_b [num_slots, out,
max_rank] the projections' B side by side (each projection's `lora_b` is a column slice of it),
scaling [P, num_slots]. `ends` gives the projections' end columns in y.

Why: a decode step's LoRA cost is launches, not bytes (rank-16 A and B of 8 adapters are a few
MiB per layer). The shrink's A rows add `P * num_slots * max_rank` rows to a GEMM that streams
thousands already, and the expand is one light launch per group: 3 a Llama layer (gate/up's runs
inside the SiLU-and-mul kernel), against the 5 launches of the fused shrink+expand kernel that
re-read A per output tile (`flexserve_kernels.lora.serve.fused`).

Rounding: s comes out of the GEMM in the model dtype (cuBLAS accumulates in fp32 and rounds once);
the delta is formed in fp32 and y rounded once, y = (y + delta) in y's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from flexserve_kernels.lora.serve.folded import FoldedLoRA, check_bypass, projection_ends
from flexserve_kernels.lora.serve.shrink import block_arg, check_launchable

__all__ = ["FoldedLoRA", "expand_bypass", "folded_lora_delta", "lora_expand_folded", "lora_expand_folded_ref",
           "check_folded_args"]


@triton.jit
def folded_lora_delta(
    s_row_ptr, b_ptr, scaling_ptr, slot, offs_n, n_mask, end0, end1, num_slots, max_rank,
    stride_bs, stride_bn, NUM_PROJ: tl.constexpr, RANK_PAD: tl.constexpr,
):
    """fp32 LoRA delta of columns `offs_n` of one token whose folded shrink row starts at
    `s_row_ptr` and whose adapter slot is `slot` (zeros when slot < 0): the expand's math, shared
    by `lora_expand_folded` and the kernels that fuse it (SiLU-and-mul)."""
    offs_r = tl.arange(0, RANK_PAD)
    r_mask = offs_r < tl.where(slot >= 0, max_rank, 0)  # no adapter: every load masked off
    slot = tl.maximum(slot, 0).to(tl.int64)
    # Each column's projection (ends increase; unused ones equal the width). A projection's shrink
    # of this slot is one short vector: load each once and pick per column.
    proj = (offs_n >= end0).to(tl.int32) + (offs_n >= end1).to(tl.int32)
    s = tl.load(s_row_ptr + slot * max_rank + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    s = tl.broadcast_to(s[None, :], (offs_n.shape[0], RANK_PAD))
    # slot was clamped to 0, so the scalar loads stay in range; r_mask zeroes s for no adapter.
    scales = tl.full(offs_n.shape, 0.0, tl.float32) + tl.load(scaling_ptr + slot)
    if NUM_PROJ > 1:
        step = num_slots * max_rank
        s1 = tl.load(s_row_ptr + step + slot * max_rank + offs_r, mask=r_mask, other=0.0).to(tl.float32)
        s = tl.where((proj == 1)[:, None], s1[None, :], s)
        scales = tl.where(proj == 1, tl.load(scaling_ptr + num_slots + slot), scales)
        if NUM_PROJ > 2:
            s2 = tl.load(s_row_ptr + 2 * step + slot * max_rank + offs_r, mask=r_mask, other=0.0).to(tl.float32)
            s = tl.where((proj == 2)[:, None], s2[None, :], s)
            scales = tl.where(proj == 2, tl.load(scaling_ptr + 2 * num_slots + slot), scales)
    b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None].to(tl.int64) * stride_bn + offs_r[None, :],
                mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    return tl.sum(s * b.to(tl.float32), axis=1) * scales


@triton.jit
def _lora_expand_folded_kernel(
    s_ptr, b_ptr, scaling_ptr, y_ptr, token_slots_ptr,
    out_size, end0, end1, num_slots, max_rank,
    stride_sm, stride_bs, stride_bn, stride_ym,
    NUM_PROJ: tl.constexpr, RANK_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Grid: (token, BLOCK_N columns of y). A token without an adapter costs one load of its slot.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + token)
    if slot < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_size
    delta = folded_lora_delta(s_ptr + token * stride_sm, b_ptr, scaling_ptr, slot, offs_n, n_mask, end0, end1,
                              num_slots, max_rank, stride_bs, stride_bn, NUM_PROJ, RANK_PAD)
    y_ptrs = y_ptr + token * stride_ym + offs_n
    y = tl.load(y_ptrs, mask=n_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=n_mask)


def expand_bypass(bypass: FoldedLoRA, y: torch.Tensor) -> None:
    """Add a group's folded bypass into its base output y [T, sum(sizes)] (in place, one launch)."""
    lora_expand_folded(bypass.s, bypass.lora_b, bypass.scaling, y, bypass.token_slots, bypass.sizes)


def lora_expand_folded(
    s: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    y: torch.Tensor,
    token_slots: torch.Tensor,
    sizes: Sequence[int],
    *,
    block_n: int | None = None,
) -> None:
    """y[t, n] += scaling[p, slot] * s[t, (p * num_slots + slot) * max_rank : +max_rank] @
    lora_b[slot, n] for every token t with slot = token_slots[t] >= 0, p the projection of column n
    (projection sizes `sizes`, 1 to 3 of them, summing to y's width); in place, one launch.

    s [T, P * num_slots * max_rank] (the folded GEMM's shrink columns), lora_b [num_slots, out,
    max_rank], scaling [P, num_slots] float32, y [T, out]; s, lora_b and y in one dtype (fp16,
    bf16 or fp32), all on one device; only last dimensions must be contiguous (s and y are
    column slices of one GEMM output). token_slots [T] int32 or int64, -1 = no adapter (those rows
    are neither read nor written); slots must be < num_slots (not checked: a device sync).
    Allocates nothing and never syncs (CUDA-graph safe). Raises ValueError on mismatched shapes,
    dtypes, devices or strides.
    """
    check_folded_args(s, lora_b, scaling, y, token_slots, sizes)
    check_launchable(y, _lora_expand_folded_kernel)
    num_tokens, out_size = y.shape
    if num_tokens == 0 or out_size == 0:
        return
    num_slots, _, max_rank = lora_b.shape
    rank_pad = triton.next_power_of_2(max_rank)
    # A [BLOCK_N, RANK_PAD] tile of B and of gathered s per program: 4096 elements (rank 16: 256
    # columns), 32 a thread at 4 warps.
    block_n = block_arg("block_n", block_n, 16) or max(16, min(4096 // rank_pad, 256, triton.next_power_of_2(out_size)))
    ends = projection_ends(sizes)
    grid = (num_tokens, triton.cdiv(out_size, block_n))
    _lora_expand_folded_kernel[grid](
        s, lora_b, scaling, y, token_slots,
        out_size, ends[0], ends[1], num_slots, max_rank,
        s.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        NUM_PROJ=len(sizes), RANK_PAD=rank_pad, BLOCK_N=block_n, num_warps=4,
    )


def lora_expand_folded_ref(
    s: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    y: torch.Tensor,
    token_slots: torch.Tensor,
    sizes: Sequence[int],
) -> None:
    """Torch reference of `lora_expand_folded` (the test oracle), same arguments and effect:
    the delta in float32, y rounded once."""
    check_folded_args(s, lora_b, scaling, y, token_slots, sizes)
    num_slots, _, max_rank = lora_b.shape
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        start = 0
        for p, size in enumerate(sizes):
            cols = slice(start, start + size)
            s_row = s[t, (p * num_slots + slot) * max_rank:(p * num_slots + slot + 1) * max_rank].float()
            delta = (lora_b[slot, cols].float() @ s_row) * scaling[p, slot]
            y[t, cols] = (y[t, cols].float() + delta).to(y.dtype)
            start += size


def check_folded_args(
    s: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, y: torch.Tensor,
    token_slots: torch.Tensor, sizes: Sequence[int],
) -> None:
    """Raise ValueError unless the arguments fit `lora_expand_folded`'s layouts."""
    if y.dim() != 2:
        raise ValueError(f"y must be [T, out], got {tuple(y.shape)}")
    if y.shape[1] > 1 and y.stride(1) != 1:
        raise ValueError(f"y must be contiguous in its last dimension, got strides {y.stride()}")
    check_bypass(s, lora_b, scaling, token_slots, sizes, y.shape[0], y.shape[1], y.dtype, y.device)

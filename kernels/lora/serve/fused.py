"""Fused decode LoRA: shrink and expand of up to three projections that share one input, in one launch.

    for k in projections, t with slot = token_slots[t] >= 0:
        y_k[t] += scaling_k[slot] * (x[t] @ lora_a_k[slot].T) @ lora_b_k[slot].T      in place

A decode step with adapters ran BGMV shrink + BGMV expand per LoRA'd projection: 14 kernels a
Llama layer, each doing almost nothing, so their count is the cost. This kernel replaces the 6 of
q/k/v with one launch and the 4 of gate/up with one (o and down take one each).

Grid: (token, output tile), the tiles of all projections laid end to end; a program finds its
projection from its tile index (sizes are runtime values, so it compares against tile counts)
and selects that projection's pointers and strides.
Each program recomputes its token's s = x[t] @ A^T for its own projection (float32, never
written to memory): A is rank x in, a few hundred KiB at most, and a second launch or a grid-wide
barrier to share s would cost more than re-reading it from L2 at decode batch sizes.

Rounding: s stays float32 and is multiplied by B in float32, as in `lora_expand_bgmv`; y is rounded
once, y = (y + scaling * s @ B^T) in y's dtype. (`lora_expand_ref` rounds the delta and then the
sum; `lora_fused_bgmv_ref` below rounds once, like the kernels.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
from flexserve_kernels.lora.serve.ref import lora_shrink_ref
from flexserve_kernels.lora.serve.shrink import block_arg, check_launchable, target_programs

# One projection: (lora_a [num_slots, max_rank, in], lora_b [num_slots, out, max_rank],
# scaling [num_slots] float32, y [T, out]).
Projection = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

MAX_PROJECTIONS = 3
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _lora_fused_bgmv_kernel(
    x_ptr, token_slots_ptr, in_size, stride_xm,
    a0_ptr, b0_ptr, scaling0_ptr, y0_ptr, out0, rank0, stride_a0s, stride_a0r, stride_b0s, stride_b0n, stride_y0m,
    a1_ptr, b1_ptr, scaling1_ptr, y1_ptr, out1, rank1, stride_a1s, stride_a1r, stride_b1s, stride_b1n, stride_y1m,
    a2_ptr, b2_ptr, scaling2_ptr, y2_ptr, out2, rank2, stride_a2s, stride_a2r, stride_b2s, stride_b2n, stride_y2m,
    NUM_PROJ: tl.constexpr, RANK_PAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # Grid: (token, tile over all projections' outputs). A token without an adapter costs one load
    # of its slot.
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    slot = tl.load(token_slots_ptr + token)
    if slot < 0:
        return
    slot = slot.to(tl.int64)

    # This tile's projection, picked with selects rather than branches: one copy of the loops (and
    # of their pipeline buffers in shared memory) serves all projections. Projections past
    # NUM_PROJ (None pointers) are never selected.
    a_ptr, b_ptr, scaling_ptr, y_ptr = a0_ptr, b0_ptr, scaling0_ptr, y0_ptr
    out_size, max_rank, stride_as, stride_ar = out0, rank0, stride_a0s, stride_a0r
    stride_bs, stride_bn, stride_ym = stride_b0s, stride_b0n, stride_y0m
    first_tile = 0
    if NUM_PROJ > 1:
        tiles_before = tl.cdiv(out0, TILE_N)
        sel = tile >= tiles_before
        a_ptr, b_ptr = tl.where(sel, a1_ptr, a_ptr), tl.where(sel, b1_ptr, b_ptr)
        scaling_ptr, y_ptr = tl.where(sel, scaling1_ptr, scaling_ptr), tl.where(sel, y1_ptr, y_ptr)
        out_size, max_rank = tl.where(sel, out1, out_size), tl.where(sel, rank1, max_rank)
        stride_as, stride_ar = tl.where(sel, stride_a1s, stride_as), tl.where(sel, stride_a1r, stride_ar)
        stride_bs, stride_bn = tl.where(sel, stride_b1s, stride_bs), tl.where(sel, stride_b1n, stride_bn)
        stride_ym, first_tile = tl.where(sel, stride_y1m, stride_ym), tl.where(sel, tiles_before, first_tile)
        if NUM_PROJ > 2:
            tiles_before += tl.cdiv(out1, TILE_N)
            sel = tile >= tiles_before
            a_ptr, b_ptr = tl.where(sel, a2_ptr, a_ptr), tl.where(sel, b2_ptr, b_ptr)
            scaling_ptr, y_ptr = tl.where(sel, scaling2_ptr, scaling_ptr), tl.where(sel, y2_ptr, y_ptr)
            out_size, max_rank = tl.where(sel, out2, out_size), tl.where(sel, rank2, max_rank)
            stride_as, stride_ar = tl.where(sel, stride_a2s, stride_as), tl.where(sel, stride_a2r, stride_ar)
            stride_bs, stride_bn = tl.where(sel, stride_b2s, stride_bs), tl.where(sel, stride_b2n, stride_bn)
            stride_ym, first_tile = tl.where(sel, stride_y2m, stride_ym), tl.where(sel, tiles_before, first_tile)

    # Shrink: the whole rank of one token at once (s must be complete before any output), as a
    # broadcast multiply-sum: one row of x gives tl.dot nothing to do (M would be padded 1 -> 16).
    offs_r = tl.arange(0, RANK_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < max_rank
    a_base = a_ptr + slot * stride_as
    a_offs = offs_r[:, None] * stride_ar + offs_k[None, :]
    x_base = x_ptr + token * stride_xm
    acc = tl.zeros((RANK_PAD, BLOCK_K), dtype=tl.float32)
    # tl.range's num_stages pipelines these loads although no tl.dot consumes them (the launch
    # option alone pipelines only loads feeding a dot): a program streams all of A[slot] by itself.
    for k in tl.range(0, in_size, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = offs_k < in_size - k
        x_vec = tl.load(x_base + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        a_tile = tl.load(a_base + a_offs, mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += a_tile * x_vec[None, :]
        x_base += BLOCK_K
        a_base += BLOCK_K
    s = tl.sum(acc, axis=1)

    # Expand this program's TILE_N outputs in BLOCK_N steps; the last tile of a projection stops
    # at its end.
    scale = tl.load(scaling_ptr + slot)
    n_start = (tile - first_tile) * TILE_N
    n_len = tl.minimum(out_size - n_start, TILE_N)
    offs_n = tl.arange(0, BLOCK_N)
    b_base = b_ptr + slot * stride_bs + n_start.to(tl.int64) * stride_bn
    b_offs = offs_n[:, None] * stride_bn + offs_r[None, :]
    y_base = y_ptr + token * stride_ym + n_start
    for n in tl.range(0, n_len, BLOCK_N, num_stages=NUM_STAGES):
        n_mask = offs_n < n_len - n
        b_tile = tl.load(b_base + b_offs, mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(b_tile * s[None, :], axis=1)
        y_vec = tl.load(y_base + offs_n, mask=n_mask, other=0.0)
        tl.store(y_base + offs_n, (y_vec.to(tl.float32) + delta * scale).to(y_vec.dtype), mask=n_mask)
        b_base += BLOCK_N * stride_bn
        y_base += BLOCK_N


def lora_fused_bgmv(
    x: torch.Tensor,
    projections: Sequence[Projection],
    token_slots: torch.Tensor,
    *,
    block_n: int | None = None,
    tile_n: int | None = None,
    block_k: int | None = None,
) -> None:
    """y_k[t] += scaling_k[slot] * (x[t] @ lora_a_k[slot].T) @ lora_b_k[slot].T for every projection
    k and every token t whose slot = token_slots[t] is >= 0, in one launch; y_k updated in place.

    x [T, in]; `projections`: 1 to 3 tuples (lora_a [num_slots, max_rank_k, in],
    lora_b [num_slots, out_k, max_rank_k], scaling [num_slots] float32, y_k [T, out_k]), all in x's
    dtype (fp16, bf16 or fp32) but scaling, on x's device, with one num_slots; token_slots [T]
    int32 or int64, -1 = no adapter (those rows of y are neither read nor written). Only last
    dimensions must be contiguous: y_k may be column slices of one wider output (a fused qkv
    GEMM). The y_k must not overlap one another or x. Slots must be < num_slots (not checked: it
    would need a device sync). Allocates nothing and never syncs, so it can be captured in a
    CUDA graph; the grid depends on T and the shapes only. Tile sizes are picked from the shapes;
    the keywords override them (tests). Raises ValueError on mismatched shapes, dtypes, devices
    or strides.
    """
    check_fused_args(x, projections, token_slots)
    check_launchable(x, _lora_fused_bgmv_kernel)
    num_tokens, in_size = x.shape
    out_sizes = [y.shape[1] for _, _, _, y in projections]
    if num_tokens == 0 or max(out_sizes) == 0:
        return
    max_rank = max(a.shape[1] for a, _, _, _ in projections)
    rank_pad = triton.next_power_of_2(max_rank)
    # Register tiles of 8192 float32 elements (the shrink's [rank, BLOCK_K] accumulator, the
    # expand's [BLOCK_N, rank] B tile; rank 16: 512 x 16): 32 a thread at 8 warps, as the BGMV
    # kernels' 4096 at 4 warps, but twice the bytes in flight per step, since one program here
    # streams a whole A[slot] alone. Three pipeline stages. ptxas (sm_90, triton 3.9, compiled
    # without a GPU): 80-105 registers, no spills, 36 KiB of shared memory in bf16 at rank 16.
    tile_elems = 8192
    block_k = block_arg("block_k", block_k, 16) or max(16, min(tile_elems // rank_pad, triton.next_power_of_2(in_size)))
    max_out = triton.next_power_of_2(max(out_sizes))
    block_n = block_arg("block_n", block_n, 16) or max(16, min(tile_elems // rank_pad, max_out))
    if tile_n is None:
        tile_n = pick_tile_n(num_tokens, in_size, out_sizes, max_rank, x.element_size(), block_n,
                             target_programs(x.device, 1))
    elif block_arg("tile_n", tile_n, 16) < block_n:
        raise ValueError(f"tile_n {tile_n} must be at least block_n {block_n}")

    args = []
    for a, b, scaling, y in projections:
        args += [a, b, scaling, y, y.shape[1], a.shape[1], a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                 y.stride(0)]
    # Projections past the given ones: None pointers and zero sizes; NUM_PROJ drops them at compile
    # time.
    args += [None, None, None, None, 0, 0, 0, 0, 0, 0, 0] * (MAX_PROJECTIONS - len(projections))
    grid = (num_tokens, _num_tiles(out_sizes, tile_n))
    _lora_fused_bgmv_kernel[grid](
        x, token_slots, in_size, x.stride(0), *args,
        NUM_PROJ=len(projections), RANK_PAD=rank_pad, BLOCK_K=block_k, BLOCK_N=block_n, TILE_N=tile_n,
        NUM_STAGES=3, num_warps=8,
    )


def pick_tile_n(
    num_tokens: int, in_size: int, out_sizes: Sequence[int], max_rank: int, elem_size: int, block_n: int,
    num_sms: int,
) -> int:
    """Outputs per program: the power of two >= block_n that least loads the busiest SM.

    A program streams all of A[slot] (rank x in) for its shrink and TILE_N rows of B for its
    expand, so more, smaller tiles repeat the A read: with P programs over num_sms SMs the busiest
    SM streams ceil(P / num_sms) * (A + TILE_N rows of B) bytes. Ties go to the smaller tile (more
    programs hide more latency). On Llama-3.1-8B's qkv (rank 16, 132 SMs) this gives 12 programs
    of 512 outputs at batch 1, 96 of 1024 at batch 16, 256 of 2048 at batch 64. A model, not a
    measurement: benchmarks/lora_fused_kernel.py times the result.
    """
    a_bytes = max_rank * in_size * elem_size
    best, best_cost = block_n, None
    tile_n = block_n
    while True:
        num_programs = num_tokens * _num_tiles(out_sizes, tile_n)
        cost = triton.cdiv(num_programs, num_sms) * (a_bytes + tile_n * max_rank * elem_size)
        if best_cost is None or cost < best_cost:
            best, best_cost = tile_n, cost
        if tile_n >= max(out_sizes):
            return best
        tile_n *= 2


def _num_tiles(out_sizes: Sequence[int], tile_n: int) -> int:
    return sum(triton.cdiv(n, tile_n) for n in out_sizes)


def lora_fused_bgmv_ref(x: torch.Tensor, projections: Sequence[Projection], token_slots: torch.Tensor) -> None:
    """Torch reference of `lora_fused_bgmv` (the test oracle and a CPU path), same arguments and
    effect: s from `lora_shrink_ref` (float32), the delta in float32, y rounded once."""
    check_fused_args(x, projections, token_slots)
    slots = token_slots.tolist()
    meta = LoRAKernelMeta.build([1] * len(slots), slots, x.device)
    for lora_a, lora_b, scaling, y in projections:
        s = lora_shrink_ref(x, lora_a, meta)
        for start, length, slot in zip(meta.seg_starts.tolist(), meta.seg_lens.tolist(), meta.seg_slots.tolist()):
            rows = slice(start, start + length)
            delta = (s[rows] @ lora_b[slot].float().T) * scaling[slot]
            y[rows] = (y[rows].float() + delta).to(y.dtype)


def check_fused_args(x: torch.Tensor, projections: Sequence[Projection], token_slots: torch.Tensor) -> None:
    """Raise ValueError unless (x, projections, token_slots) fit `lora_fused_bgmv`'s layouts."""
    if x.dim() != 2:
        raise ValueError(f"lora_fused_bgmv wants x [T, in], got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be one of {_DTYPES}, got {x.dtype}")
    if token_slots.dim() != 1 or token_slots.shape[0] != x.shape[0]:
        raise ValueError(f"token_slots must be [T] for x's {x.shape[0]} tokens, got {tuple(token_slots.shape)}")
    if token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be int32 or int64, got {token_slots.dtype}")
    if not 1 <= len(projections) <= MAX_PROJECTIONS:
        raise ValueError(f"lora_fused_bgmv takes 1 to {MAX_PROJECTIONS} projections, got {len(projections)}")
    num_slots = None
    for k, projection in enumerate(projections):
        if len(projection) != 4:
            raise ValueError(f"projection {k} must be (lora_a, lora_b, scaling, y), got {len(projection)} items")
        lora_a, lora_b, scaling, y = projection
        if lora_a.dim() != 3 or lora_b.dim() != 3 or scaling.dim() != 1 or y.dim() != 2:
            raise ValueError(f"projection {k} wants lora_a [num_slots, max_rank, in], lora_b [num_slots, out, "
                             f"max_rank], scaling [num_slots] and y [T, out], got lora_a {tuple(lora_a.shape)}, "
                             f"lora_b {tuple(lora_b.shape)}, scaling {tuple(scaling.shape)}, y {tuple(y.shape)}")
        slots, max_rank, in_size = lora_a.shape
        if in_size != x.shape[1]:
            raise ValueError(f"projection {k}: lora_a {tuple(lora_a.shape)} does not take x's hidden size {x.shape[1]}")
        if slots == 0 or max_rank == 0:
            raise ValueError(f"projection {k}: lora_a {tuple(lora_a.shape)} has no slot or no rank")
        if num_slots is None:
            num_slots = slots
        if slots != num_slots or lora_b.shape[0] != num_slots or scaling.shape[0] != num_slots:
            raise ValueError(f"projection {k}: lora_a, lora_b and scaling have {slots}, {lora_b.shape[0]} and "
                             f"{scaling.shape[0]} slots; every projection must have {num_slots}")
        if lora_b.shape[2] != max_rank:
            raise ValueError(f"projection {k}: lora_b {tuple(lora_b.shape)} does not match lora_a's "
                             f"max_rank {max_rank}")
        if tuple(y.shape) != (x.shape[0], lora_b.shape[1]):
            raise ValueError(f"projection {k}: y {tuple(y.shape)} must be [T, out] = "
                             f"{(x.shape[0], lora_b.shape[1])}")
        if lora_a.dtype != x.dtype or lora_b.dtype != x.dtype or y.dtype != x.dtype:
            raise ValueError(f"projection {k}: lora_a, lora_b and y must have x's dtype {x.dtype}, got "
                             f"{lora_a.dtype}, {lora_b.dtype} and {y.dtype}")
        if scaling.dtype != torch.float32:
            raise ValueError(f"projection {k}: scaling must be float32, got {scaling.dtype}")
        for name, t in (("lora_a", lora_a), ("lora_b", lora_b), ("scaling", scaling), ("y", y)):
            # A size-1 dimension may carry any stride; the kernel never steps along it.
            if t.shape[-1] > 1 and t.stride(-1) != 1:
                raise ValueError(f"projection {k}: {name} must be contiguous in its last dimension, "
                                 f"got strides {t.stride()}")
            if t.device != x.device:
                raise ValueError(f"projection {k}: {name} is on {t.device} but x is on {x.device}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must be contiguous in its last dimension, got strides {x.stride()}")
    if token_slots.device != x.device:
        raise ValueError(f"token_slots is on {token_slots.device} but x is on {x.device}")

"""LoRA expand, y[t] += scaling[slot] * s[t] @ lora_b[slot].T in place, as SGMV and BGMV.

Rows of y for tokens without an adapter are never read or written. The sum is float32 and y is
rounded once (the reference rounds the delta, then the sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
from flexserve_kernels.lora.serve.ref import check_expand_args
from flexserve_kernels.lora.serve.shrink import (
    block_arg,
    busy_tiles,
    check_launchable,
    target_programs,
    tile_map_args,
)


@triton.jit
def _lora_expand_sgmv_kernel(
    s_ptr, b_ptr, y_ptr, scaling_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, tile_map_ptr,
    out_size, max_rank, num_map_tiles,
    stride_sm, stride_bs, stride_bn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    USE_TILE_MAP: tl.constexpr,
):
    # Grid: (segment, token tile, output tile); token tiles past a segment's end exit here. With a
    # tile map (CUDA graphs): (map entry, output tile), entry i naming its segment and token
    # tile, -1 empty.
    if USE_TILE_MAP:
        seg = tl.load(tile_map_ptr + tl.program_id(0))
        if seg < 0:
            return
        pid_m = tl.load(tile_map_ptr + num_map_tiles + tl.program_id(0))
        pid_n = tl.program_id(1)
    else:
        seg = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)

    # 64-bit scalar bases, 32-bit offsets within the tile (ptxas, sm_90, triton 3.9: int64 offsets
    # made the 64 x 128 bf16 tile spill 216 bytes at 4 warps).
    m_start = pid_m * BLOCK_M
    n_start = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = offs_m < seg_len - m_start
    n_mask = offs_n < out_size - n_start
    row_start = (seg_start + m_start).to(tl.int64)
    s_base = s_ptr + row_start * stride_sm
    # lora_b[slot] is [out, max_rank]; read it as its transpose [BLOCK_R, BLOCK_N] for the dot.
    b_base = b_ptr + slot * stride_bs + n_start.to(tl.int64) * stride_bn
    s_offs = offs_m[:, None] * stride_sm + offs_r[None, :]
    b_offs = offs_n[None, :] * stride_bn + offs_r[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, max_rank, BLOCK_R):
        r_mask = offs_r < max_rank - r
        s_tile = tl.load(s_base + s_offs, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        b_tile = tl.load(b_base + b_offs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        # float32 s meets 16-bit B in B's dtype (one rounding of s, relative 2^-9 in bf16) so the
        # dot runs on tensor cores; float32 B keeps it exact (ieee, no TF32).
        acc = tl.dot(s_tile.to(b_tile.dtype), b_tile, acc, input_precision="ieee")
        s_base += BLOCK_R
        b_base += BLOCK_R
    scale = tl.load(scaling_ptr + slot)
    y_ptrs = y_ptr + row_start * stride_ym + n_start + (offs_m[:, None] * stride_ym + offs_n[None, :])
    mask = m_mask[:, None] & n_mask[None, :]
    y_tile = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y_tile.to(tl.float32) + acc * scale).to(y_tile.dtype), mask=mask)


@triton.jit
def _lora_expand_bgmv_kernel(
    s_ptr, b_ptr, y_ptr, scaling_ptr, token_slots_ptr,
    out_size, max_rank,
    stride_sm, stride_bs, stride_bn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # Grid: (token, output tile); a token without an adapter costs one load of its slot.
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    slot = tl.load(token_slots_ptr + token)
    if slot < 0:
        return
    n_start = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < out_size - n_start
    s_base = s_ptr + token * stride_sm
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + n_start.to(tl.int64) * stride_bn
    b_offs = offs_n[:, None] * stride_bn + offs_r[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r in range(0, max_rank, BLOCK_R):
        r_mask = offs_r < max_rank - r
        s_vec = tl.load(s_base + offs_r, mask=r_mask, other=0.0).to(tl.float32)
        b_tile = tl.load(b_base + b_offs, mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b_tile * s_vec[None, :], axis=1)
        s_base += BLOCK_R
        b_base += BLOCK_R
    scale = tl.load(scaling_ptr + slot)
    y_ptrs = y_ptr + token * stride_ym + n_start + offs_n
    y_vec = tl.load(y_ptrs, mask=n_mask, other=0.0)
    tl.store(y_ptrs, (y_vec.to(tl.float32) + acc * scale).to(y_vec.dtype), mask=n_mask)


def lora_expand_sgmv(
    s: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoRAKernelMeta,
    y: torch.Tensor,
    scaling: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_r: int | None = None,
) -> torch.Tensor:
    """SGMV expand over meta's segments into y (returned); base tokens' rows are untouched.

    Block sizes are picked from the shapes; the keywords override them (tests).
    """
    check_expand_args(s, lora_b, meta, y, scaling)
    check_launchable(y, _lora_expand_sgmv_kernel)
    if not meta.has_lora:
        return y
    out_size, max_rank = lora_b.shape[1:]
    # tl.dot needs K >= 16: ranks below 16 are padded (masked); ranks above 64 loop in 64s.
    block_r = block_arg("block_r", block_r, 16) or min(max(16, triton.next_power_of_2(max_rank)), 64)
    block_m = block_arg("block_m", block_m, 16) or min(max(16, triton.next_power_of_2(meta.max_seg_len)), 64)
    if meta.tile_map is not None:
        block_m = meta.tile_block_m
    num_m_tiles = triton.cdiv(meta.max_seg_len, block_m)
    if block_n is None:
        # 128 outputs (256 bytes of a 16-bit y row) per tile, halved down to 32 while the busy
        # tiles would leave SMs idle (few tokens, narrow outputs such as k/v at 1024).
        num_busy = busy_tiles(meta, block_m)
        block_n = 64 if y.dtype == torch.float32 else 128
        while block_n > 32 and num_busy * triton.cdiv(out_size, block_n) < target_programs(y.device):
            block_n //= 2
    else:
        block_arg("block_n", block_n, 16)
    tile_map, num_map_tiles = tile_map_args(meta)
    if tile_map is None:
        grid = (meta.num_segments, num_m_tiles, triton.cdiv(out_size, block_n))
    else:
        grid = (num_map_tiles, triton.cdiv(out_size, block_n))
    _lora_expand_sgmv_kernel[grid](
        s, lora_b, y, scaling, meta.seg_starts, meta.seg_lens, meta.seg_slots,
        meta.seg_lens if tile_map is None else tile_map,  # any pointer when unused
        out_size, max_rank, num_map_tiles,
        s.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, USE_TILE_MAP=tile_map is not None,
        # ptxas (sm_90, triton 3.9): 64 x 128 spills at 4 warps, 160 registers at 8; 32 x 128 with
        # rank 64 spills at 4. 8 warps from 4096 accumulator elements.
        num_warps=8 if block_m * block_n >= 4096 else 4, num_stages=2,
    )
    return y


def lora_expand_bgmv(
    s: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoRAKernelMeta,
    y: torch.Tensor,
    scaling: torch.Tensor,
    *,
    block_n: int | None = None,
    block_r: int | None = None,
) -> torch.Tensor:
    """BGMV expand, one program per (token, output tile), into y (returned); base tokens' rows are
    untouched. Reads meta.token_slots only, so it is right for any batch; fast for one-token rows."""
    check_expand_args(s, lora_b, meta, y, scaling)
    check_launchable(y, _lora_expand_bgmv_kernel)
    num_tokens = y.shape[0]
    out_size, max_rank = lora_b.shape[1:]
    block_r = block_arg("block_r", block_r, 1) or min(triton.next_power_of_2(max_rank), 128)
    if block_n is None:
        # A [block_n, block_r] B tile of 4096 elements (32 a thread at 4 warps), halved down to 32
        # outputs while the grid is under ~4 programs per SM (batch 1 with k/v's 1024 outputs).
        block_n = max(16, min(256, 4096 // block_r))
        while block_n > 32 and num_tokens * triton.cdiv(out_size, block_n) < target_programs(y.device, 4):
            block_n //= 2
    else:
        block_arg("block_n", block_n, 1)
    grid = (num_tokens, triton.cdiv(out_size, block_n))
    _lora_expand_bgmv_kernel[grid](
        s, lora_b, y, scaling, meta.token_slots,
        out_size, max_rank,
        s.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_N=block_n, BLOCK_R=block_r, num_warps=4,
    )
    return y

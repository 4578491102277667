"""Rotary embedding of q and k in place, and the rotated K with V into their paged-cache slots,
in one launch: `rotary_embedding` followed by `kv_cache_write`, fused.

A decode step would otherwise launch both per layer (about 2.3 and 1.4 µs on an H200 at batch 1,
plus the gap between them), and the rotary kernel's one program per token walks all query heads
serially. Here the grid is (token, query-head tile + 1): the extra program of each token rotates
its K heads, stores them back in place and into the cache, and copies V into the cache. The
arithmetic is `rotary_embedding`'s (each product rounded to the input dtype), so the results are
bit-equal to the two kernels run one after the other. A negative slot skips the cache write of
that token (CUDA-graph padding), not its rotation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flexserve_kernels.attention.kv_cache_write import check_kv_cache_write_args
from flexserve_kernels.norm_rope.rotary import (
    _cos_sin,
    _heads_view,
    _rotate_heads,
    _rotate_tile,
    check_rotary_args,
)


@triton.jit
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, cos_sin_ptr, positions_ptr, slot_mapping_ptr,
    num_heads, num_kv_heads, block_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_ckv, stride_cb, stride_cslot, stride_ch,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    cos, sin, offs_d, d_mask = _cos_sin(cos_sin_ptr, positions_ptr, token, stride_cs,
                                        q_ptr.dtype.element_ty, HALF, BLOCK_HALF)
    first = tile * BLOCK_H
    if first < num_heads:  # a tile of query heads
        _rotate_heads(q_ptr + token * stride_qt + first * stride_qh, stride_qh,
                      tl.minimum(num_heads - first, BLOCK_H), cos, sin, offs_d, d_mask,
                      HALF, BLOCK_H)
        return
    # The token's K heads (rotated, in place and into the cache) and V heads (into the cache).
    offs_h = tl.arange(0, BLOCK_KV)
    mask = (offs_h < num_kv_heads)[:, None] & d_mask[None, :]
    out1, out2 = _rotate_tile(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh
                              + offs_d[None, :], mask, cos, sin, HALF)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cache_ty = cache_ptr.dtype.element_ty
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cslot
    dst = cache_ptr + dst + offs_h[:, None] * stride_ch
    tl.store(dst + offs_d[None, :], out1.to(cache_ty), mask=mask)
    tl.store(dst + HALF + offs_d[None, :], out2.to(cache_ty), mask=mask)
    offs_v = tl.arange(0, BLOCK_D)
    v_mask = (offs_h < num_kv_heads)[:, None] & (offs_v < 2 * HALF)[None, :]
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :],
                mask=v_mask)
    tl.store(dst + stride_ckv + offs_v[None, :], v.to(cache_ty), mask=v_mask)


def rope_kv_write(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding(positions, query, key, cos_sin_cache, head_dim)` then
    `kv_cache_write(key, value, kv_cache, slot_mapping)`, in one launch; returns (query, key),
    rotated in place. Shapes, dtypes and checks as those two functions: query [T, H*D] or
    [T, H, D], key/value [T, KV*D] or [T, KV, D] (rows may be strided slices of a fused qkv
    output), kv_cache [2, num_blocks, block_size, KV, D]. No host sync: CUDA-graph safe.
    """
    q = _heads_view(query, head_dim, "query")
    k = _heads_view(key, head_dim, "key")
    v = _heads_view(value, head_dim, "value")
    check_rotary_args(positions, q, k, cos_sin_cache, head_dim)
    check_kv_cache_write_args(k, v, kv_cache, slot_mapping)
    num_tokens, num_heads, num_kv_heads = q.shape[0], q.shape[1], k.shape[1]
    if num_tokens == 0:
        return query, key
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    # About 1024 elements of each half per query program: 4 programs for Llama-3.1-8B's 32 heads.
    block_h = max(1, min(triton.next_power_of_2(num_heads), 1024 // block_half))
    grid = (num_tokens, triton.cdiv(num_heads, block_h) + 1)
    _rope_kv_write_kernel[grid](
        q, k, v, kv_cache, cos_sin_cache, positions, slot_mapping,
        num_heads, num_kv_heads, kv_cache.shape[2],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        HALF=half, BLOCK_HALF=block_half, BLOCK_H=block_h,
        BLOCK_KV=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
    return query, key

"""Neox-style (rotate-half) rotary embedding applied in place to q and k in one launch.

Matches flexserve.layers.rotary.apply_rotary_emb on `RotaryEmbedding.cos_sin_cache` gathered by
position: cos/sin are rounded to x's dtype first, and x1*cos, x2*sin and their sum/difference are
each rounded to x's dtype, as torch's eager ops do. So 16-bit results equal the eager path (up to
an FMA contraction on the GPU) and the greedy tokens of the two paths can be compared exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(
    x_ptr, stride_h, num_heads, cos, sin, offs_d, d_mask,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    for h0 in range(0, num_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
        _rotate_tile(x_ptr + offs_h[:, None] * stride_h + offs_d[None, :], mask, cos, sin, HALF)


@triton.jit
def _rotate_tile(ptr1, mask, cos, sin, HALF: tl.constexpr):
    # Rotate the heads whose first halves `ptr1` points at, in place; returns the rotated
    # halves. Each product is rounded to x's dtype, as the eager ops do.
    x_ty = ptr1.dtype.element_ty
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    a = (x1 * cos).to(x_ty).to(tl.float32)
    b = (x2 * sin).to(x_ty).to(tl.float32)
    c = (x2 * cos).to(x_ty).to(tl.float32)
    d = (x1 * sin).to(x_ty).to(tl.float32)
    out1 = (a - b).to(x_ty)
    out2 = (c + d).to(x_ty)
    tl.store(ptr1, out1, mask=mask)
    tl.store(ptr1 + HALF, out2, mask=mask)
    return out1, out2


@triton.jit
def _cos_sin(cos_sin_ptr, positions_ptr, token, stride_cs, x_ty: tl.constexpr,
             HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # The token's cos and sin rows [1, BLOCK_HALF], rounded to x's dtype, with their offsets.
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0)
    return (cos.to(x_ty).to(tl.float32)[None, :], sin.to(x_ty).to(tl.float32)[None, :],
            offs_d, d_mask)


@triton.jit
def _rotary_embedding_kernel(
    q_ptr, k_ptr, cos_sin_ptr, positions_ptr,
    num_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # One program per token: its cos/sin row is read once for all q and k heads.
    token = tl.program_id(0).to(tl.int64)
    cos, sin, offs_d, d_mask = _cos_sin(cos_sin_ptr, positions_ptr, token, stride_cs,
                                        q_ptr.dtype.element_ty, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, cos, sin, offs_d, d_mask,
                  HALF, BLOCK_H)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, offs_d, d_mask,
                  HALF, BLOCK_H)


def _heads_view(x: torch.Tensor, head_dim: int, name: str) -> torch.Tensor:
    """x [T, N*D] or [T, N, D] as [T, N, D] heads; ValueError for a bad shape or head_dim."""
    if head_dim % 2 != 0 or head_dim <= 0:
        raise ValueError(f"head_dim must be even and positive, got {head_dim}")
    if x.dim() == 2:
        if x.shape[1] % head_dim != 0:
            raise ValueError(f"{name} width {x.shape[1]} is not a multiple of head_dim {head_dim}")
        if x.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
        return x.view(x.shape[0], -1, head_dim)
    if x.dim() != 3 or x.shape[2] != head_dim:
        raise ValueError(f"{name} must be [T, N*{head_dim}] or [T, N, {head_dim}], got {tuple(x.shape)}")
    if x.stride(2) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")
    return x


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key in place at `positions` [T]; returns (query, key).

    query [T, H*D] or [T, H, D], key [T, KV*D] or [T, KV, D] (one dtype; rows may be strided, e.g.
    slices of a fused qkv output); cos_sin_cache [max_position, D] float32 with cos in the first
    half and sin in the second (`RotaryEmbedding.cos_sin_cache`). Positions must be in range (not
    checked: that would need a host sync). CUDA-graph safe.
    """
    q = _heads_view(query, head_dim, "query")
    k = _heads_view(key, head_dim, "key")
    check_rotary_args(positions, q, k, cos_sin_cache, head_dim)
    num_tokens = q.shape[0]
    if num_tokens > 0:
        half = head_dim // 2
        block_half = triton.next_power_of_2(half)
        # About 2048 elements of each half per step: all 32 q heads of Llama-3.1-8B at once.
        block_h = max(1, min(triton.next_power_of_2(max(q.shape[1], k.shape[1])), 2048 // block_half))
        _rotary_embedding_kernel[(num_tokens,)](
            q, k, cos_sin_cache, positions,
            q.shape[1], k.shape[1],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            HALF=half, BLOCK_HALF=block_half, BLOCK_H=block_h, num_warps=4,
        )
    return query, key


def check_rotary_args(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    """ValueError unless q [T, H, D] and k [T, KV, D] (head views) rotate at `positions` [T]
    with `cos_sin_cache` [max_position, D], all on one device."""
    num_tokens = q.shape[0]
    if k.shape[0] != num_tokens or positions.shape != (num_tokens,):
        raise ValueError(f"query has {num_tokens} tokens, key {k.shape[0]}, positions "
                         f"{tuple(positions.shape)}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        raise ValueError(f"query and key must share a dtype in {_DTYPES}, got {q.dtype}, {k.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be [max_position, {head_dim}] with a contiguous last "
                         f"dimension, got {tuple(cos_sin_cache.shape)}")
    if not (q.device == k.device == positions.device == cos_sin_cache.device):
        raise ValueError("positions, query, key and cos_sin_cache must be on one device")


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `rotary_embedding` (RotaryEmbedding.forward's arithmetic), in place."""
    cos, sin = cos_sin_cache.index_select(0, positions.long()).to(query.dtype).unsqueeze(1).chunk(2, -1)
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_dim)
        x1, x2 = heads.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        heads.copy_(rotated)
    return query, key

"""A step's new K and V into their paged-cache slots, both in one launch.

The cache of one layer is [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V);
token t goes to flat slot slot_mapping[t] = block_id * block_size + offset. A negative slot skips
the token, so a CUDA graph captured for a padded batch can point its padding tokens at -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _kv_cache_write_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
    num_kv_heads, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckv, stride_cb, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid: (token, head tile). One program moves BLOCK_H heads of K and the same heads of V.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    dst = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    cache_ty = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + dst, k.to(cache_ty), mask=mask)
    tl.store(cache_ptr + stride_ckv + dst, v.to(cache_ty), mask=mask)


def kv_cache_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [T, num_kv_heads, head_dim] into kv_cache at `slot_mapping` [T], in place.

    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]; K and V are cast to its dtype.
    key/value may be strided views (e.g. slices of a fused qkv output) whose last dim is
    contiguous. Tokens whose slot is negative are skipped. No host sync: CUDA-graph safe.
    """
    check_kv_cache_write_args(key, value, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    # Up to 2048 elements of K (and as many of V) per program: Llama-3.1-8B's 8 x 128 in one.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 2048 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _kv_cache_write_kernel[grid](
        key, value, kv_cache, slot_mapping,
        num_kv_heads, kv_cache.shape[2],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )


def check_kv_cache_write_args(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                              slot_mapping: torch.Tensor) -> None:
    """ValueError unless key/value [T, KV, D] fit `kv_cache` [2, num_blocks, block_size, KV, D]
    at `slot_mapping` [T], all on one device."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [T, num_kv_heads, head_dim], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != key.shape[1:]:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not [2, num_blocks, block_size, "
                         f"{key.shape[1]}, {key.shape[2]}]")
    if slot_mapping.shape != key.shape[:1] or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{key.shape[0]}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if key.dtype not in _DTYPES or value.dtype != key.dtype or kv_cache.dtype not in _DTYPES:
        raise ValueError(f"key/value/kv_cache dtypes must be in {_DTYPES} (key and value equal), got "
                         f"{key.dtype}, {value.dtype}, {kv_cache.dtype}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("key, value and kv_cache must be contiguous in their last dimension")
    if not (key.device == value.device == kv_cache.device == slot_mapping.device):
        raise ValueError("key, value, kv_cache and slot_mapping must be on one device")


def kv_cache_write_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference of `kv_cache_write` (flexserve.layers.attention.write_kv_cache, plus
    skipping negative slots)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[keep].to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[keep].to(kv_cache.dtype))

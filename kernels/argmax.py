"""Row argmax over a vocabulary, the greedy sampler's pick, in two short launches.

torch.argmax gives each row one thread block, which walks Llama-3's 128,256 logits alone: 27 us
on an H200 for one row or 32. Here a row is cut into BLOCK-wide chunks, one program each, that
report their maximum and its first index; a second launch reduces a row's chunk results. The
answer is torch.argmax's: the first index of the maximum, and a NaN counts as the maximum (the
floats are compared as order-preserving int32 keys, every NaN mapped to the largest key).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 4096


@triton.jit
def _ordered_key(v):
    """float32 -> int32 whose signed order is the floats' order; +-0 -> 0, any NaN -> INT32_MAX."""
    bits = v.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(v == 0.0, 0, key)  # -0.0 == 0.0
    return tl.where(v != v, 0x7FFFFFFF, key)


@triton.jit
def _chunk_argmax_kernel(
    x_ptr, key_ptr, idx_ptr, V, stride_x, num_chunks, BLOCK: tl.constexpr,
):
    # Grid: (rows, chunks). Writes the chunk's largest key and the first index holding it.
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    key = tl.where(offs < V, _ordered_key(v), -0x7FFFFFFF - 1)
    best = tl.max(key, axis=0)
    first = tl.min(tl.where(key == best, offs, 0x7FFFFFFF), axis=0)
    tl.store(key_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


@triton.jit
def _row_argmax_kernel(key_ptr, idx_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr):
    # Grid: (rows,). Chunks are in index order, so the smallest index among the best keys wins.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS)
    mask = offs < num_chunks
    key = tl.load(key_ptr + row * num_chunks + offs, mask=mask, other=-0x7FFFFFFF - 1)
    idx = tl.load(idx_ptr + row * num_chunks + offs, mask=mask, other=0x7FFFFFFF)
    best = tl.max(key, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(key == best, idx, 0x7FFFFFFF), axis=0).to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (float16/bfloat16/float32, last dimension contiguous) -> int64 [N], the
    first index of each row's maximum (a NaN is the maximum), as `logits.argmax(dim=-1)`."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    if logits.dtype not in _DTYPES:
        raise ValueError(f"logits must be one of {_DTYPES}, got {logits.dtype}")
    num_rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("argmax of an empty row")
    if vocab >= 2**31 - 1:
        raise ValueError(f"rows of at most 2**31 - 2 entries, got {vocab}")
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous in their last dimension")
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, block)
    keys = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    idx = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(num_rows, num_chunks)](
        logits, keys, idx, vocab, logits.stride(0), num_chunks, BLOCK=block, num_warps=8)
    _row_argmax_kernel[(num_rows,)](
        keys, idx, out, num_chunks, CHUNKS=triton.next_power_of_2(num_chunks), num_warps=1)
    return out


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """Torch reference of `argmax`."""
    return logits.argmax(dim=-1)

"""Skinny linear layer for decode: y = x W^T (+ b) for a few rows x, W [N, K] as nn.Linear holds it.

At one to a few rows a decode GEMM is a pass over W; what it costs is how close the pass comes
to the memory bandwidth. cuBLAS reaches 4.1 TB/s on Llama-3.1-8B's gate/up weight on an H200
but 2.5-3.2 TB/s on the smaller q/k/v and o weights (o with a split-K reduce kernel after it).
This kernel is the plain streaming form: each program owns BLOCK_N output columns (W rows),
walks K in BLOCK_K steps with every row of x, and keeps a [rows, BLOCK_N, BLOCK_K] fp32
partial sum in registers that it reduces over K once at the end. No split-K, no second launch,
no atomics: the result is deterministic and CUDA-graph safe.

The fp32 sum is rounded to x's dtype exactly once and then stored as `out_dtype` (x's dtype by
default), so `out_dtype=torch.float32` gives F.linear(...).float() (the lm_head's logits) in one
launch. The sums run in another order than cuBLAS's: results are within an ulp of the output of
the fp32 sum rounded once (tests/test_gemv_argmax_kernels.py), not bit-equal to cuBLAS.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flexserve_kernels.configs import CONFIGS_DIR
from flexserve_kernels.tuned_configs import device_name, load_configs

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 4  # the most rows it takes; on an H200 it beats cuBLAS at one row only


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, ROUND_TY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    # Grid: (column tiles,). ROWS is M rounded up to a power of two.
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        else:
            mask_k = (k + offs_k) < K
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = y.to(ROUND_TY)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def gemv_config(n: int, k: int, device: torch.device | str | None = None) -> dict:
    """BLOCK_N, BLOCK_K, num_warps and num_stages for `gemv` of weight [n, k] on device (the
    configs file's "gemv": its entry for "NxK", else its default). num_stages stays 1: the loads
    feed no tl.dot, so nothing is pipelined."""
    return _gemv_config(n, k, device_name(device))


@functools.lru_cache(maxsize=256)
def _gemv_config(n: int, k: int, name: str | None) -> dict:
    tuned = load_configs(CONFIGS_DIR, name)["gemv"]
    c = tuned.get("by_shape", {}).get(f"{n}x{k}", tuned["default"])
    return dict(BLOCK_N=c["block_n"], BLOCK_K=c["block_k"], num_warps=c["num_warps"], num_stages=c["num_stages"])


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    out_dtype: torch.dtype | None = None, config: dict | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] for 1 <= M <= MAX_ROWS.

    x and weight share a dtype; the fp32 sum is rounded to that dtype, then stored as
    `out_dtype` (default the same: F.linear; torch.float32: F.linear(...).float() in one pass).
    Rows of x and weight may be strided; their last dimension must be contiguous.
    `config` overrides `gemv_config` (the benchmark's sweep)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    num_rows, k = x.shape
    n = weight.shape[0]
    if not 1 <= num_rows <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows, got {num_rows}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype in {_DTYPES}, got {x.dtype}, {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous in their last dimension")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device
                             or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous {x.dtype} [{n}] on {x.device}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in _DTYPES:
        raise ValueError(f"out_dtype must be one of {_DTYPES}, got {out_dtype}")
    out = torch.empty(num_rows, n, dtype=out_dtype, device=x.device)
    if n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(num_rows, n) if bias is not None else torch.zeros_like(out))
    cfg = dict(gemv_config(n, k, x.device) if config is None else config)
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    block_k = min(block_k, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias, out, num_rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ROWS=triton.next_power_of_2(num_rows),
        ROUND_TY=_TL_DTYPES[x.dtype], BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        **cfg,
    )
    return out


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch reference of `gemv`: F.linear, then the dtype conversion."""
    y = torch.nn.functional.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)

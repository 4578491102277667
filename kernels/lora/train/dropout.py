"""LoRA dropout's keep mask written out as a bool tensor, with the fused kernels' counter hash.

The fused LoRA kernels regenerate the mask in registers (`lora_fused_train.dropout_keep`; the
fine-tuning engine's forward shrink and its backward run them on the GPU); code that applies
dropout with torch ops (a plan that keeps the mask as a bitmask or the dropout output, an fp16
model's backward, rematerializing a dropout output) needs it as a tensor. This kernel writes it in
one pass, n x width bytes; the torch reference (`lora_fused_train_ref.dropout_keep_ref`) builds
several int64 intermediates of the mask's size: on an H200 its int64 elementwise kernels took
about 33 ms per 4096-token Llama-3.1-8B sequence with dropout on down_proj, about 1 ms a layer
(docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flexserve_kernels.lora.serve.shrink import check_launchable
from flexserve_kernels.lora.train.fused import dropout_keep, keep_threshold, kernel_seed


@triton.jit(do_not_specialize=["num_rows", "seed"])  # both change every window: no recompiles
def _dropout_keep_mask_kernel(keep_ptr, num_rows, num_cols, seed, p, stride,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = dropout_keep(seed, rows, cols, keep_threshold(p))
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    tl.store(keep_ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :], keep, mask=mask)


def dropout_keep_mask(seed: int, num_rows: int, num_cols: int, p: float,
                      device: torch.device | str) -> torch.Tensor:
    """bool [num_rows, num_cols]: the elements dropout with probability p keeps, bit for bit
    `dropout_keep_ref(seed, num_rows, num_cols, p)` (seed in [0, 2**32); `row_seed` shifts rows)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    keep = torch.empty(num_rows, num_cols, dtype=torch.bool, device=device)
    check_launchable(keep, _dropout_keep_mask_kernel)
    if keep.numel() == 0:
        return keep
    block_m, block_n = (32, 256) if keep.is_cuda else (16, 32)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_cols, block_n))
    _dropout_keep_mask_kernel[grid](keep, num_rows, num_cols, kernel_seed(seed), p, keep.stride(0),
                                    BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return keep

"""Copy rows between two 2-D tensors by index: dst[dst_index[i]] = src[src_index[i]] for i < count.

What a CUDA graph of a mixed iteration does with each activation a fine-tuning plan keeps: the
fine-tuning rows of the flat batch go to their sequences' rows of the activation arena. torch's
`index_select` + `index_copy_` read and write every row twice and cover the whole padded bucket;
this reads and writes each real row once, and rows at or past `count` (a device scalar, so the
graph needs no host value) exit at once. `src` may be a column slice of a wider tensor (strided
rows); its first `dst.shape[1]` columns are copied, cast to dst's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flexserve_kernels.dispatch import use_triton

BLOCK = 1024  # columns per program


@triton.jit
def _copy_rows_kernel(src_ptr, src_index_ptr, dst_ptr, dst_index_ptr, count_ptr, width,
                      stride_src, stride_dst, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if row >= tl.load(count_ptr):
        return
    src_row = tl.load(src_index_ptr + row).to(tl.int64)
    dst_row = tl.load(dst_index_ptr + row).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    x = tl.load(src_ptr + src_row * stride_src + offs, mask=mask)
    tl.store(dst_ptr + dst_row * stride_dst + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


def copy_rows(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor,
              src_index: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """dst[dst_index[i], :W] = src[src_index[i], :W] for i < count[0], W = dst.shape[1]; returns
    dst. dst_index and src_index are int64 [N] (N >= count), count an int32 [1] on the device."""
    if dst.dim() != 2 or src.dim() != 2 or src.shape[1] < dst.shape[1]:
        raise ValueError(f"copy_rows wants 2-D tensors with src at least as wide as dst, got "
                         f"dst {tuple(dst.shape)} and src {tuple(src.shape)}")
    if dst.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError("copy_rows wants contiguous columns")
    if dst_index.shape != src_index.shape or count.numel() != 1:
        raise ValueError(f"copy_rows wants index vectors of one length and one count, got "
                         f"{tuple(dst_index.shape)}, {tuple(src_index.shape)}, {count.numel()}")
    if not use_triton(dst.device):
        return copy_rows_ref(dst, dst_index, src, src_index, count)
    width = dst.shape[1]
    grid = (dst_index.shape[0], triton.cdiv(width, BLOCK))
    _copy_rows_kernel[grid](src, src_index, dst, dst_index, count, width, src.stride(0),
                            dst.stride(0), BLOCK=BLOCK, num_warps=4)
    return dst


def copy_rows_ref(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor,
                  src_index: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The torch reference of `copy_rows` (reads `count` on the host)."""
    n = int(count.reshape(-1)[0])
    rows = src.index_select(0, src_index[:n])[:, :dst.shape[1]]
    dst.index_copy_(0, dst_index[:n], rows.to(dst.dtype))
    return dst

"""The model's dense projections: the skinny Triton GEMV for one-row (batch-1 decode) inputs
where `use_triton` says so, F.linear everywhere else.

At one row cuBLAS streams Llama-3.1-8B's q/k/v, o and down weights at 2.5-3.7 TB/s on an H200,
`flexserve_kernels.gemv` at 3.2-4.0; on the merged gate/up weight the two trade places between
runs (56-60 us each), and the lm_head's fp32 logits come out of the GEMV's one pass
(docs/benchmarks.md). At two rows and more cuBLAS is faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexserve_kernels.dispatch import use_triton


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), converted to `out_dtype` when given (rounded to x's dtype
    first either way). x is [T, in_features]."""
    if (x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1 and weight.stride(1) == 1
            and use_triton(x.device)):
        from flexserve_kernels.gemv import gemv

        return gemv(x, weight, bias, out_dtype=out_dtype)
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)

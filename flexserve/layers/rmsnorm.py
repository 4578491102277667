"""RMSNorm as HF LlamaRMSNorm: normalize in fp32, cast back, then scale by the weight.

Where `use_triton` says so (CUDA), one fused Triton kernel (flexserve_kernels.norm_rope.rmsnorm) does the
residual add and the norm with the same roundings; elsewhere the torch code below.
"""

from __future__ import annotations

import torch
from torch import nn

from flexserve_kernels.dispatch import use_triton


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); optionally adds a residual first.

    With `residual`, returns (norm(x + residual), x + residual): the decoder's residual add fused
    into the call. The add runs in x's dtype, exactly as HF's `residual + hidden_states`.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_triton(x.device):
            from flexserve_kernels.norm_rope.rmsnorm import rmsnorm

            return rmsnorm(x, self.weight, self.variance_epsilon, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"

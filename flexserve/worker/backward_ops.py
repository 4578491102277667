"""The elementwise math of the layer-wise backward (`layer_backward`): RMSNorm forward (for
rematerialization) and backward, the rope backward and the SiLU-and-mul backward.

Each backward has two paths with the same fp32 math. The torch path runs op by op in fp32
(anywhere). Where `use_triton` says so (CUDA), the `fused_*` functions run it as Triton kernels
(flexserve_kernels.finetune_backward) in registers: the SiLU-and-mul backward in one pass (dgate,
dup) and the rope backward (which also widens dQ), each written into a new tensor of the dtype
the caller picks: fp32, or a frozen projection's dtype when that projection's dX GEMM is the
output's one reader (the rounding its cast would do anyway). The fused RMSNorm backward, summed
with the residual add's gradient, is called by `SequenceBackward` directly: where it writes
depends on the window's gradient bookkeeping (`backward_gradients`).
"""

from __future__ import annotations

import torch

from flexserve.layers.rotary import rotate


def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm` without a residual: normalize in fp32, cast back, scale."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rmsnorm_backward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor
) -> torch.Tensor:
    """fp32 dL/dx of y = weight * x / rms(x) (frozen weight), given dL/dy."""
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    d = grad * weight.float()
    return rstd * (d - h * (rstd * rstd) * (d * h).mean(-1, keepdim=True))


def rope_backward(
    grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """The rotation's transpose: rotate by -angle (also right for scaled cos/sin, e.g. YaRN)."""
    return rotate(grad, cos, -sin, head_dim)


def silu_mul_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (dL/dgate, dL/dup) of m = silu(gate) * up, given grad = dL/dm (fp32)."""
    gate, up = gate.float(), up.float()
    sig = torch.sigmoid(gate)
    return grad * up * sig * (1 + gate * (1 - sig)), grad * (gate * sig)


def fused_rope_backward(
    grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """`rope_backward` as one Triton kernel, written into a new `dtype` tensor; grad may be
    16-bit (the kernel widens it as it reads it)."""
    from flexserve_kernels.finetune_backward import rope_backward as rope_backward_fused

    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    return rope_backward_fused(grad, cos, sin, head_dim, out)


def fused_silu_mul_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
    dtypes: tuple[torch.dtype, torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul_backward` as one Triton kernel pass, dL/dgate and dL/dup written into new
    tensors of `dtypes`; the inputs may be 16-bit (widened in registers)."""
    from flexserve_kernels.finetune_backward import silu_mul_backward as silu_mul_backward_fused

    outs = [torch.empty(grad.shape, dtype=dtype, device=grad.device) for dtype in dtypes]
    return silu_mul_backward_fused(grad, gate, up, *outs)

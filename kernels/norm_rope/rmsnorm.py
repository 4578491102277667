"""RMSNorm fused with the decoder's residual add, as flexserve.layers.rmsnorm.RMSNorm.

With a residual: new_residual = x + residual (rounded to x's dtype, like torch's add), then
out = weight * (new_residual / sqrt(mean(new_residual^2) + eps)) with the normalization in fp32,
rounded to x's dtype before the weight multiply (HF's LlamaRMSNorm order). Every rounding of the
eager path happens at the same point, so only the fp32 sum of squares (order) and rsqrt differ:
results match the eager module bitwise or within one unit in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# One program holds a whole row; 32768 covers every hidden size in use (Llama-3.1-405B: 16384).
MAX_HIDDEN_SIZE = 32768


@triton.jit
def _rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    hidden_size, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    # One row per program, loaded whole before anything is stored: out may alias x and
    # residual_out may alias residual (in-place use).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x_ty = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(x_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
    normed = (x * rstd).to(x_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [T, hidden] (after adding `residual` [T, hidden] when given).

    Returns `out` without a residual, (out, new_residual) with one, as `RMSNorm.forward`. out has
    the dtype of `weight * x` (torch promotion), new_residual x's dtype. `out` / `residual_out`
    may be given (CUDA graphs, in-place: out=x, residual_out=residual); otherwise allocated.
    """
    if x.dim() != 2 or weight.shape != x.shape[1:]:
        raise ValueError(f"rmsnorm wants x [T, hidden] and weight [hidden], got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise ValueError(f"rmsnorm dtypes must be in {_DTYPES}, got x {x.dtype}, weight {weight.dtype}")
    hidden_size = x.shape[1]
    if hidden_size > MAX_HIDDEN_SIZE:
        raise ValueError(f"hidden size {hidden_size} > {MAX_HIDDEN_SIZE} (one row per program)")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != out_dtype:
        raise ValueError(f"out must be {out_dtype} {tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
    tensors = {"x": x, "weight": weight, "out": out}
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must be {x.dtype} {tuple(x.shape)}, got "
                             f"{residual.dtype} {tuple(residual.shape)}")
        if residual_out is None:
            residual_out = torch.empty_like(x)
        elif residual_out.shape != x.shape or residual_out.dtype != x.dtype:
            raise ValueError(f"residual_out must be {x.dtype} {tuple(x.shape)}")
        tensors.update(residual=residual, residual_out=residual_out)
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if x.shape[0] > 0:
        block = triton.next_power_of_2(hidden_size)
        # About 8-16 elements per thread: 4096 (Llama-3.1-8B) -> 8 warps.
        num_warps = min(16, max(1, block // 512))
        res = residual if residual is not None else x
        res_out = residual_out if residual is not None else out
        _rmsnorm_kernel[(x.shape[0],)](
            x, res, weight, out, res_out,
            hidden_size, eps,
            x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
        )
    return out if residual is None else (out, residual_out)


def rmsnorm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `rmsnorm`: RMSNorm.forward's arithmetic, step by step."""
    if residual is not None:
        x = x + residual
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, x)

"""The elementwise parts of the fine-tuning backward (flexserve.worker.finetune.layer_backward), fused.

Each kernel reads its inputs once in whatever dtype they are held (fp32, or the model's dtype for
activations and for gradients that are exact products of a model-dtype GEMM), does the fp32 math
of the torch reference in registers, and writes each result once: the references below are the
exact arithmetic of layer_backward's torch path (one op per line there, each an fp32 tensor of
the projection's width in memory). Outputs are fp32 unless a caller passes a model-dtype `out`,
which rounds the fp32 result once at the store, exactly as the torch path's `.to(weight.dtype)`
before the next frozen projection's dX GEMM.

- `silu_mul_backward`: dL/dgate and dL/dup of m = silu(gate) * up;
- `rmsnorm_backward`: dL/dx of y = weight * x / rms(x) (frozen weight), optionally summed with
  the gradient x already has from the residual add, in place;
- `rope_backward`: the rotation's transpose (rotate by -angle) of a [T, N*head_dim] gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# One program holds a whole row; 32768 covers every hidden size in use (Llama-3.1-405B: 16384).
MAX_HIDDEN_SIZE = 32768


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device,
                dtypes: tuple[torch.dtype, ...] = _DTYPES) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be in {dtypes}, got {t.dtype}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _out(name: str, out: torch.Tensor | None, shape: tuple[int, ...], device: torch.device,
         dtypes: tuple[torch.dtype, ...] = _DTYPES) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    _check_rows(name, out, shape, device, dtypes)
    return out


# ------------------------------------------------------------------------------ SiLU-and-mul
@triton.jit
def _silu_mul_bwd_kernel(
    grad_ptr, gate_ptr, up_ptr, d_gate_ptr, d_up_ptr,
    width,
    stride_grad, stride_gate, stride_up, stride_dg, stride_du,
    BLOCK: tl.constexpr,
):
    # Grid: (row, column tile). Same products in the same order as silu_mul_backward_ref.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(grad_ptr + row * stride_grad + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    d_gate = g * b * sig * (1.0 + a * (1.0 - sig))
    d_up = g * (a * sig)
    tl.store(d_gate_ptr + row * stride_dg + cols, d_gate.to(d_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(d_up_ptr + row * stride_du + cols, d_up.to(d_up_ptr.dtype.element_ty), mask=mask)


def silu_mul_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
    out_gate: torch.Tensor | None = None, out_up: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/dgate, dL/dup) of m = silu(gate) * up given grad = dL/dm, all [n, I], in one pass.

    grad, gate and up may each be fp32 or 16-bit (read and widened to fp32); rows may be strided
    (e.g. column slices of a fused gate_up output), the last dimension must be contiguous. The
    outputs are fp32 unless `out_gate` / `out_up` are given (fp32 or 16-bit, written once, rounded
    from the fp32 result). No host syncs; CUDA-graph safe when the outputs are given.
    """
    if grad.dim() != 2:
        raise ValueError(f"grad must be [n, I], got {list(grad.shape)}")
    shape, device = tuple(grad.shape), grad.device
    for name, t in (("grad", grad), ("gate", gate), ("up", up)):
        _check_rows(name, t, shape, device)
    out_gate = _out("out_gate", out_gate, shape, device)
    out_up = _out("out_up", out_up, shape, device)
    num_rows, width = shape
    if num_rows > 0 and width > 0:
        # 1024 columns at 4 warps = 8 fp32 per thread; Llama-3.1-8B's 14336 -> 14 tiles per row.
        block = min(1024, triton.next_power_of_2(width))
        _silu_mul_bwd_kernel[(num_rows, triton.cdiv(width, block))](
            grad, gate, up, out_gate, out_up, width,
            grad.stride(0), gate.stride(0), up.stride(0), out_gate.stride(0), out_up.stride(0),
            BLOCK=block, num_warps=4,
        )
    return out_gate, out_up


def silu_mul_backward_ref(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `silu_mul_backward`: layer_backward's torch path, op by op in fp32."""
    grad, gate, up = grad.float(), gate.float(), up.float()
    sig = torch.sigmoid(gate)
    return grad * up * sig * (1 + gate * (1 - sig)), grad * (gate * sig)


# ------------------------------------------------------------------------------------ RMSNorm
@triton.jit
def _rmsnorm_bwd_kernel(
    x_ptr, weight_ptr, grad_ptr, acc_ptr, out_ptr,
    hidden_size, eps,
    stride_x, stride_grad, stride_acc, stride_out,
    HAS_ACC: tl.constexpr, BLOCK: tl.constexpr,
):
    # One row per program, loaded whole before the store: out may alias acc (in-place sum).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + row * stride_grad + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden_size + eps)
    d = g * w
    mean_dh = tl.sum(d * h, axis=0) / hidden_size
    dx = rstd * (d - h * (rstd * rstd) * mean_dh)
    if HAS_ACC:
        dx = tl.load(acc_ptr + row * stride_acc + cols, mask=mask, other=0.0).to(tl.float32) + dx
    tl.store(out_ptr + row * stride_out + cols, dx, mask=mask)


def rmsnorm_backward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor,
    accumulate: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 dL/dx of y = weight * x / rms(x) (frozen weight) given grad = dL/dy, x and grad [n, H].

    With `accumulate` [n, H] (the gradient x already has, e.g. through the residual add that x
    also feeds), returns accumulate + dL/dx, written into `accumulate` itself (fp32) unless `out`
    is given; without it, dL/dx into `out` or a new fp32 tensor. `out` is fp32 and may be
    `accumulate`. x, weight and grad may be fp32 or 16-bit; rows may be strided, the last
    dimension must be contiguous. One program per row (H <= 32768), reductions in fp32.
    """
    if x.dim() != 2 or tuple(weight.shape) != tuple(x.shape[1:]):
        raise ValueError(f"rmsnorm_backward wants x [n, H] and weight [H], got {list(x.shape)} "
                         f"and {list(weight.shape)}")
    shape, device = tuple(x.shape), x.device
    if shape[1] > MAX_HIDDEN_SIZE:
        raise ValueError(f"hidden size {shape[1]} > {MAX_HIDDEN_SIZE} (one row per program)")
    _check_rows("x", x, shape, device)
    _check_rows("weight", weight, shape[1:], device)
    _check_rows("grad", grad, shape, device)
    if accumulate is not None:
        _check_rows("accumulate", accumulate, shape, device)
        if out is None:
            if accumulate.dtype != torch.float32:
                raise ValueError(f"in-place accumulate must be fp32, got {accumulate.dtype}")
            out = accumulate
    out = _out("out", out, shape, device, (torch.float32,))
    num_rows, hidden_size = shape
    if num_rows > 0 and hidden_size > 0:
        block = triton.next_power_of_2(hidden_size)
        # About 8-16 fp32 per thread: 4096 (Llama-3.1-8B) -> 8 warps, as the forward kernel.
        num_warps = min(16, max(1, block // 512))
        acc = accumulate if accumulate is not None else out
        _rmsnorm_bwd_kernel[(num_rows,)](
            x, weight, grad, acc, out, hidden_size, eps,
            x.stride(0), grad.stride(0), acc.stride(0), out.stride(0),
            HAS_ACC=accumulate is not None, BLOCK=block, num_warps=num_warps,
        )
    return out


def rmsnorm_backward_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor,
    accumulate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of `rmsnorm_backward` (layer_backward's torch path); never in place."""
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    d = grad.float() * weight.float()
    dx = rstd * (d - h * (rstd * rstd) * (d * h).mean(-1, keepdim=True))
    return dx if accumulate is None else accumulate.float() + dx


# ------------------------------------------------------------------------------------- RoPE
@triton.jit
def _rope_bwd_kernel(
    grad_ptr, cos_ptr, sin_ptr, out_ptr,
    num_heads,
    stride_grad, stride_cos, stride_sin, stride_out,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # One program per token: its cos/sin row is read once for all heads. Both halves of a head
    # are loaded before either is stored, so out may be grad (in place).
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + token * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    neg_sin = -tl.load(sin_ptr + token * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    cos, neg_sin = cos[None, :], neg_sin[None, :]
    out_ty = out_ptr.dtype.element_ty
    for h0 in range(0, num_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
        cols = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        grad_row = grad_ptr + token * stride_grad + cols
        out_row = out_ptr + token * stride_out + cols
        x1 = tl.load(grad_row, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(grad_row + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row, (x1 * cos - x2 * neg_sin).to(out_ty), mask=mask)
        tl.store(out_row + HALF, (x2 * cos + x1 * neg_sin).to(out_ty), mask=mask)


def _cos_sin_rows(name: str, t: torch.Tensor, num_tokens: int, half: int,
                  device: torch.device) -> torch.Tensor:
    if t.dim() == 3 and t.shape[1] == 1:
        t = t[:, 0]
    _check_rows(name, t, (num_tokens, half), device)
    return t


def rope_backward(
    grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dL/dx of the neox (rotate-half) rotation x -> rope(x) given grad [n, N*head_dim]: the
    rotation by -angle, in fp32 (right for scaled cos/sin too, e.g. YaRN).

    cos, sin: [n, 1, head_dim / 2] or [n, head_dim / 2] (fp32, as `RotaryEmbedding.cos_sin_cache`
    rows; rows may be strided). grad may be fp32 or 16-bit, rows strided. Returns a new fp32
    tensor, or `out` (fp32 or 16-bit, rounded once; may be grad itself for in place).
    """
    if head_dim <= 0 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even and positive, got {head_dim}")
    if grad.dim() != 2 or grad.shape[1] % head_dim != 0:
        raise ValueError(f"grad must be [n, N*{head_dim}], got {list(grad.shape)}")
    shape, device, half = tuple(grad.shape), grad.device, head_dim // 2
    _check_rows("grad", grad, shape, device)
    cos = _cos_sin_rows("cos", cos, shape[0], half, device)
    sin = _cos_sin_rows("sin", sin, shape[0], half, device)
    out = _out("out", out, shape, device)
    num_tokens, num_heads = shape[0], shape[1] // head_dim
    if num_tokens > 0 and num_heads > 0:
        block_half = triton.next_power_of_2(half)
        # About 2048 elements of each half per step: all 32 q heads of Llama-3.1-8B at once.
        block_h = max(1, min(triton.next_power_of_2(num_heads), 2048 // block_half))
        _rope_bwd_kernel[(num_tokens,)](
            grad, cos, sin, out, num_heads,
            grad.stride(0), cos.stride(0), sin.stride(0), out.stride(0),
            HALF=half, HEAD_DIM=head_dim, BLOCK_HALF=block_half, BLOCK_H=block_h, num_warps=4,
        )
    return out


def rope_backward_ref(
    grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """Torch reference of `rope_backward`: layer_backward's rotate(grad, cos, -sin) in fp32."""
    num_tokens, half = grad.shape[0], head_dim // 2
    x1, x2 = grad.float().view(num_tokens, -1, head_dim).chunk(2, dim=-1)
    cos, sin = cos.reshape(num_tokens, 1, half), -sin.reshape(num_tokens, 1, half)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).view(num_tokens, -1)

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

The LoRA products read 16-bit activations (a target's input, stored in the model's dtype) with
fp32 gradients. `mm_fp32` runs a product of two 16-bit operands as one cuBLAS GEMM with an fp32
result on CUDA (the values of widening both first: a product of two 16-bit floats is exact in
fp32, the sums are fp32), without the widened copies; `split_bf16` writes an fp32 operand as two
bf16 terms so that it can join such a GEMM (hi + lo is within 2^-17 of it).

`window_attention` is the SDPA call whose autograd gives the attention backward: queries of the
window [end - n, end) over keys [0, end), with grouped K/V (GQA) passed as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from flexserve.layers.rotary import rotate


_16BIT = (torch.float16, torch.bfloat16)


def _fp32_output_gemm(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether cuBLAS can take a and b as they are and write fp32 (torch's out_dtype overload)."""
    return a.is_cuda and a.dtype == b.dtype and a.dtype in _16BIT


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 sums, as an fp32 tensor: widened operands' product, or on CUDA with two
    16-bit operands of one dtype the same products in one GEMM with an fp32 output."""
    if _fp32_output_gemm(a, b):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def addmm_fp32(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 c + a @ b (a, b of one 16-bit dtype on CUDA: one GEMM that adds c in its epilogue
    and rounds once; elsewhere the widened product added to c). A new tensor; c is not written."""
    if _fp32_output_gemm(a, b):
        return torch.addmm(c, a, b, out_dtype=torch.float32)
    return c + a.float() @ b.float()


def split_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 x [n, k] as bf16 [n, 2k] = [hi | lo] with hi + lo within 2^-17 |x| of x (8 + 8
    significant bits), so x @ w ~= [hi | lo] @ [w; w] runs on 16-bit GEMMs."""
    hi = x.to(torch.bfloat16)
    return torch.cat([hi, (x - hi.float()).to(torch.bfloat16)], dim=1)


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


def window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of a backward window, out [1, H, n, D]: q [1, H, n, D] holds positions
    [end - n, end), k and v [1, KV, end, D] positions [0, end), query head h reads KV head
    h // (H / KV). Run under autograd, its backward gives dK, dV already summed per KV head.

    The mask is `causal_lower_right(n, end)` (query i sees keys up to end - n + i) and K/V keep
    their KV heads (`enable_gqa`), so on CUDA the call is one fused kernel with no K/V copy
    (torch 2.11-2.13): `CausalBias` runs SDPA with `is_causal=True` when n == end (flash,
    which takes grouped K/V) and otherwise, when `can_use_flash_attention` accepts the
    inputs with enable_gqa, the flash kernel itself (`_scaled_dot_product_flash_attention`,
    whose causal mask is lower-right aligned and whose backward sums dK, dV over each group).
    Its non-flash fallbacks are not GQA-safe, so K/V are expanded where flash would not run
    (fp32 on CUDA: the memory-efficient kernel), and on the CPU (the exactness reference, not
    a fast path: SDPA's math path would expand them anyway, and expanding here keeps the CPU's
    bf16 roundings those of the torch and fused backward paths alike).

    On CUDA cuDNN's attention is excluded (`WINDOW_SDPA_BACKENDS`): it builds an execution plan
    per new shape, and window shapes vary (latency-sized windows, sequence lengths). On the H200
    (Llama-3.1-8B, co-serving windows) those builds made one backward iteration in ~27 take
    110-190 ms against ~25-40 ms predicted; with flash they are gone and fine-tuning under the
    SLO ran 37% faster (docs/benchmarks.md, session 7)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads and not _grouped_kv_fused(q, k, v):
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    mask = causal_lower_right(q.shape[2], k.shape[2])
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=k.shape[1] != heads)
    with sdpa_kernel(WINDOW_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=k.shape[1] != heads)


# The SDPA kernels a backward window's attention may use on CUDA, in torch's order: no cuDNN.
WINDOW_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH]


def _grouped_kv_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether SDPA with a lower-right `CausalBias` gets K/V with fewer heads than q: only on
    CUDA where the flash kernel takes them (`CausalBias` calls the memory-efficient kernel
    directly otherwise, which expects equal heads)."""
    if q.device.type != "cuda":
        return False
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True))

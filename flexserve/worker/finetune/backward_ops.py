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

On the fused path (CUDA, a bf16 or fp32 model) the adapter ops' backward runs as fused LoRA
training kernels (flexserve_kernels.lora.train.fused_bwd) with the same precision: the shrink's
as `fused_lora_a_backward` (dA, and dX's LoRA term with dropout' applied, dS split into two
16-bit halves as `split_bf16` does), the dropout mask regenerated in registers from the window's
seed, never read or rebuilt as a tensor; the expand's as `fused_lora_b_backward` (dB and dS in
fp32). `SequenceBackward.lora_kernel_paths` says where each runs.

`window_attention` is the SDPA call whose autograd gives the attention backward: queries of the
window [end - n, end) over keys [0, end), with grouped K/V (GQA) passed as they are. A window
that covers the whole prefix (n == end) can instead run on cuDNN padded to a bucket length
(`padded_prefix_attention`, FLEXSERVE_WINDOW_ATTENTION=cudnn-buckets), once the start-up
warm-up built that bucket's plans in the calling thread (`warm_prefix_attention`).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from flexserve import envs
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


# ------------------------------------------------------------------------ fused LoRA backward
@functools.lru_cache(maxsize=64)
def _window_meta(num_tokens: int, device: torch.device) -> Any:
    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta

    return LoRAKernelMeta.build([num_tokens], [0], device)  # one adapter, "slot" 0 of the views


@functools.lru_cache(maxsize=32)
def _train_slots(p: float, device: torch.device, count: int = 1) -> Any:
    """`count` slots with dropout p and scaling 1 (kernels 4 and 5 do not scale; kernel 3 takes
    the adapters' scalings with these slots' dropout_ps)."""
    from flexserve_kernels.lora.train.fused import LoRATrainSlots

    return LoRATrainSlots(torch.ones(count, device=device), torch.full((count,), p, device=device), p > 0)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_lora_a_backward(grad_s: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, p: float,
                          seed: int, grad_a: torch.Tensor, *, x_dropped: bool,
                          want_dx: bool, meta: Any = None) -> torch.Tensor | None:
    """The backward of an adapter's shrink (and its dropout) over a window, as kernels: adds
    dS^T dropout(x) to grad_a [r, in] (fp32, in place; fused LoRA kernel 5) and returns dL/dx's
    LoRA term dropout'(dS A) [n, in] fp32 (kernel 4's term) when `want_dx`, both from one pass
    over x (`lora_train_dx_term_da_bwd`).
    x [n, in] is the adapter's input before dropout, whose mask the kernels regenerate from `seed`
    (`dropout_window_seed`), or after it when `x_dropped` (a stored dropout output). dS (fp32)
    enters the 16-bit products as two 16-bit halves, as `split_bf16` does on the torch path.
    With `meta` (a `LoRAKernelMeta`; no dropout) the rows are several adapters' segments:
    lora_a and grad_a are [slots, r, in], each row's dS [r] its own slot's, and the term's rows
    outside every segment zero."""
    from flexserve_kernels.lora.train.fused_bwd import lora_train_da_bwd, lora_train_dx_term_da_bwd

    device, n = grad_s.device, grad_s.shape[0]
    grad_s = _rows(grad_s)
    if meta is None:
        meta, lora_a, grad_a = _window_meta(n, device), lora_a[None], grad_a[None]
        slots, da_slots = _train_slots(p, device), _train_slots(0.0 if x_dropped else p, device)
    elif p > 0:
        raise ValueError("several adapters' rows take no dropout here")
    else:
        slots = da_slots = _train_slots(0.0, device, lora_a.shape[0])
    if not want_dx:
        lora_train_da_bwd(_rows(x), grad_s, lora_a, meta, da_slots, seed, split_ds=True, da_out=grad_a)
        return None
    term, _ = lora_train_dx_term_da_bwd(_rows(x), grad_s, lora_a, meta, slots, seed, out_dtype=torch.float32,
                                        split_ds=True, x_dropped=x_dropped, da_out=grad_a)
    return term


def fused_lora_b_backward(grad_y: torch.Tensor, s: torch.Tensor, lora_b: torch.Tensor,
                          scaling: torch.Tensor, grad_b: torch.Tensor, meta: Any = None) -> torch.Tensor:
    """The backward of an adapter's expand over a window as fused LoRA kernel 3, from one pass
    over dY: adds scaling dY^T S to grad_b [out, r] (fp32, contiguous, in place) and returns dS
    = scaling dY B [n, r] (fp32). dY [n, out] and the products are fp32 (B widened, S read in
    its dtype), as the torch path's GEMMs; `scaling` a one-element device tensor (the slot's
    entry, read when the kernel runs). With `meta` (a `LoRAKernelMeta`) the rows are several
    adapters' segments: lora_b and grad_b are [slots, out, r] and scaling [slots], each row's S
    and dS its own slot's, dS zero outside every segment."""
    from flexserve_kernels.lora.train.fused import LoRATrainSlots
    from flexserve_kernels.lora.train.fused_bwd import lora_train_ds_db_bwd

    device = grad_y.device
    if meta is None:
        meta, lora_b, grad_b = _window_meta(grad_y.shape[0], device), lora_b[None], grad_b[None]
    slots = LoRATrainSlots(scaling, _train_slots(0.0, device, lora_b.shape[0]).dropout_ps, False)
    ds, _ = lora_train_ds_db_bwd(_rows(grad_y), lora_b.float(), _rows(s), meta, slots, db_out=grad_b)
    return ds


def fused_lora_dropout_shrink(x: torch.Tensor, lora_a: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """S [n, r] fp32 = dropout(x) A^T over a window as fused LoRA kernel 1 (the forward's shrink):
    x [n, in] is the adapter's input before dropout, whose mask the kernel hashes in registers from
    `seed` (`dropout_window_seed`), so neither the mask nor the dropout output is built. The
    window's meta and slot are cached device tensors and the seed a kernel argument: no copy to
    the device per call (a pageable copy waits for the stream's work)."""
    from flexserve_kernels.lora.train.fused import lora_train_shrink_fwd

    meta = _window_meta(x.shape[0], x.device)
    return lora_train_shrink_fwd(_rows(x), lora_a[None], meta, _train_slots(p, x.device), seed,
                                 out_dtype=torch.float32)


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

    On CUDA cuDNN's attention is excluded from that call (`WINDOW_SDPA_BACKENDS`): it builds an
    execution plan per new shape, and window shapes vary (latency-sized windows, sequence
    lengths). On the H200 (Llama-3.1-8B, co-serving windows) those builds made one backward
    iteration in ~27 take 110-190 ms against ~25-40 ms predicted; with flash they are gone and
    fine-tuning under the SLO ran 37% faster (docs/benchmarks.md). cuDNN was faster
    at a fixed shape, though, so with FLEXSERVE_WINDOW_ATTENTION=cudnn-buckets a window that
    covers the whole prefix (n == end) and pads to a bucket of `CUDNN_MIN_PREFIX_BUCKET` rows
    or more runs on cuDNN padded to `prefix_bucket(end)` rows (`padded_prefix_attention`:
    grouped K/V as they are, exact), but only where this thread has built that bucket's plans
    (`warm_prefix_attention`, run by the fine-tuning warm-up) and `can_use_cudnn_attention`
    accepts the inputs, so no plan is ever built mid-serving; windows with start > 0, shorter
    ones and any bucket not warmed take the path above."""
    heads, kv_heads, end = q.shape[1], k.shape[1], k.shape[2]
    if (q.device.type == "cuda" and q.shape[2] == end
            and envs.window_attention() == "cudnn-buckets"):
        length = prefix_bucket(end)
        if (length >= CUDNN_MIN_PREFIX_BUCKET and _warm_key(q, k, length, scale) in _warm_plans()
                and _cudnn_accepts(q, k, v)):
            return padded_prefix_attention(q, k, v, scale, length, [SDPBackend.CUDNN_ATTENTION])
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


# Bucket lengths: multiples of 128 up to 1024, then 8 per octave (multiples of 2^k / 8 in
# (2^k, 2^(k+1)]). Past 1024 rows a window is padded by less than 1/8 of its length, under 1.27x
# its causal attention FLOPs (1.09x on average over the lengths 1025-131072); shorter windows
# pad by under 128 rows. Few plans, from `CUDNN_MIN_PREFIX_BUCKET` up: 5 buckets up to 4096
# rows, 13 up to 8192, 45 up to 131072 (multiples of 512 would need 251 up to 131072, powers
# of two pad up to 2x).
PREFIX_BUCKET_MIN_STEP = 128
PREFIX_BUCKETS_PER_OCTAVE = 8
# Shorter whole-prefix windows keep flash: the cuDNN path costs ~0.7 ms per call however short
# the window (mostly host time: 0.6-0.9 ms against flash's 0.3 ms). One layer's window attention
# forward + backward, back to back (H200, torch 2.11 + cuDNN 9.19, bf16, 32 query / 8 KV heads
# of 128, windows of a bucket length): 0.75-0.89 ms on cuDNN against 0.25-0.41 ms on flash up to
# 1536 rows, 0.76-1.05 against 0.61-0.87 ms at 2048-2560, then 0.91x flash's time at 3072 and
# 0.58-0.64x from 3584 to 16384 (1.10 against 1.89 ms at 4096). A one-off probe, not a
# benchmark: rerun `finetune_throughput.py` with each FLEXSERVE_WINDOW_ATTENTION to move this.
CUDNN_MIN_PREFIX_BUCKET = 3072


def prefix_bucket(length: int) -> int:
    """The padded length of a whole-prefix window of `length` rows (see the bucket comment)."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    # For length in (2^k, 2^(k+1)], (length - 1).bit_length() is k + 1.
    octave = 1 << (length - 1).bit_length()
    step = max(PREFIX_BUCKET_MIN_STEP, octave // (2 * PREFIX_BUCKETS_PER_OCTAVE))
    return -(-length // step) * step


def prefix_buckets(max_length: int) -> list[int]:
    """Every bucket length up to `prefix_bucket(max_length)`, ascending: the plans a job whose
    sequences hold at most `max_length` tokens can use."""
    top, buckets = prefix_bucket(max_length), []
    while not buckets or buckets[-1] < top:
        buckets.append(prefix_bucket(buckets[-1] + 1 if buckets else 1))
    return buckets


def cudnn_prefix_buckets(max_length: int) -> list[int]:
    """The bucket lengths whose whole-prefix windows run on cuDNN (from
    `CUDNN_MIN_PREFIX_BUCKET`) for sequences of at most `max_length` tokens: what the warm-up
    builds."""
    return [b for b in prefix_buckets(max_length) if b >= CUDNN_MIN_PREFIX_BUCKET]


def padded_prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, length: int,
    backends: list[SDPBackend],
) -> torch.Tensor:
    """Causal attention of a whole-prefix window, out [1, H, end, D] (q [1, H, end, D] and k, v
    [1, KV, end, D] all of positions [0, end)), computed by SDPA (`is_causal`, grouped K/V as
    they are, restricted to `backends`) on copies zero-padded to `length` >= end rows.

    Exact, also under autograd: padded query rows come after every real key and padded keys
    after every real query, so the causal mask hides the padding from every real row and the
    real rows' outputs are those of the unpadded call. The padded rows' outputs are cut off,
    so their output gradient is zero: in the backward dV_j = sum_i P_ij dO_i, dP_ij = dO_i . V_j
    and dS_ij = P_ij (dP_ij - sum_d dO_id O_id) are all exactly zero on those rows (their
    softmax is finite: row i always sees key 0), so they add nothing to dK, dV of the real keys
    and get dQ 0; the padded keys' dK, dV (from padded queries alone) and the padded queries'
    dQ are dropped with the padding. The padding is zeros: any finite rows would do, but not
    whatever a fresh buffer holds (a NaN there makes its row's dS NaN, and 0 * NaN is NaN).

    The copies are one layout whatever the inputs' strides, [1, length, heads, D] storage seen
    as [1, heads, length, D] (the layout of the window's own q, k, v), and so is the output
    gradient handed to SDPA (cuDNN's plan cache keys on the q, k, v strides but bakes in the
    output gradient's too)."""
    end = q.shape[2]
    q, k, v = (_PadRows.apply(t, length) for t in (q, k, v))
    with sdpa_kernel(backends):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
    return _TakeRows.apply(out, end)


def _rows_buffer(like: torch.Tensor, rows: int) -> torch.Tensor:
    """An uninitialized [b, h, rows, d] tensor over [b, rows, h, d] storage."""
    b, h, _, d = like.shape
    return like.new_empty((b, rows, h, d)).transpose(1, 2)


class _PadRows(torch.autograd.Function):
    """x [b, h, n, d] -> [b, h, length, d] with zero rows appended; the gradient of x is the
    first n rows of the output's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, length: int) -> torch.Tensor:
        ctx.rows = x.shape[2]
        out = _rows_buffer(x, length)
        out[:, :, :ctx.rows].copy_(x)
        out[:, :, ctx.rows:].zero_()
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[:, :, :ctx.rows], None


class _TakeRows(torch.autograd.Function):
    """The first n rows of x [b, h, length, d] (a view); the gradient is the output's padded
    with zero rows, written in `_rows_buffer`'s layout whatever the layout of the output's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.length = x.shape[2]
        return x[:, :, :rows]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        rows = grad.shape[2]
        full = _rows_buffer(grad, ctx.length)
        full[:, :, :rows].copy_(grad)
        full[:, :, rows:].zero_()
        return full, None


def _cudnn_accepts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether SDPA's cuDNN kernel takes this whole-prefix window (is_causal, grouped K/V): the
    checks of its padded copies but the sequence lengths, which only pass more easily there."""
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention

    return can_use_cudnn_attention(
        SDPAParams(q, k, v, None, 0.0, True, q.shape[1] != k.shape[1]))


# The whole-prefix buckets whose cuDNN plans this thread built (`warm_prefix_attention`). Per
# thread because torch keeps cuDNN's attention plans per thread (thread_local caches in ATen's
# cudnn/MHA.cpp): plans built in the loading thread do nothing for another thread's windows.
_thread_state = threading.local()


def _warm_plans() -> set[tuple]:
    plans = getattr(_thread_state, "warm_plans", None)
    if plans is None:
        plans = _thread_state.warm_plans = set()
    return plans


def _warm_key(q: torch.Tensor, k: torch.Tensor, length: int, scale: float) -> tuple:
    """What cuDNN's plan depends on: device, dtype, head counts, head dim and the padded length
    (the padded layout follows from them), and the scale."""
    return (q.get_device(), q.dtype, q.shape[1], k.shape[1], q.shape[3], length, float(scale))


def warm_prefix_attention(
    lengths: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device, scale: float,
) -> list[int]:
    """Build, in the calling thread, cuDNN's forward and backward plans of whole-prefix windows
    padded to each of `lengths` (random q, k, v through `padded_prefix_attention` under
    autograd, as `window_attention` runs them), and let this thread's `window_attention` use
    them. Returns the lengths built: it stops at the first that cuDNN refuses or that does not
    fit in memory (windows of those lengths keep the flash path)."""
    built = []
    for length in lengths:
        try:
            key = _run_prefix_window(length, heads, kv_heads, head_dim, dtype, device, scale)
        except torch.OutOfMemoryError:
            break
        if key is None:
            break
        _warm_plans().add(key)
        built.append(length)
    return built


def _run_prefix_window(length: int, heads: int, kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device, scale: float) -> tuple | None:
    """Forward and backward of one random whole-prefix window of `length` rows on cuDNN; its
    `_warm_key`, or None where cuDNN refuses it."""
    with torch.inference_mode(False), torch.enable_grad():
        q, k, v = (torch.randn((1, length, h, head_dim), device=device, dtype=dtype)
                   .transpose(1, 2).requires_grad_() for h in (heads, kv_heads, kv_heads))
        if not _cudnn_accepts(q, k, v):
            return None
        out = padded_prefix_attention(q, k, v, scale, length, [SDPBackend.CUDNN_ATTENTION])
        out.backward(torch.randn_like(out))
    return _warm_key(q, k, length, scale)

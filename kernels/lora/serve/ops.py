"""The LoRA ops the layers call: SGMV or BGMV Triton kernels on GPU, the torch references on CPU.

Triton is imported only when a kernel is about to run, so the CPU server works without it. On
CPU the kernels run under Triton's interpreter when TRITON_INTERPRET=1 (the tests); otherwise
the references in lora_ref.py do the work.
"""

from __future__ import annotations

import torch

from flexserve import envs
from flexserve_kernels.dispatch import use_triton
from flexserve_kernels.lora.serve import cuda_ext
from flexserve_kernels.lora.serve.meta import DropoutWindows, LoRAKernelMeta
from flexserve_kernels.lora.serve.ref import (
    check_expand_args,
    check_shrink_args,
    lora_expand_ref,
    lora_shrink_ref,
)

VARIANTS = ("sgmv", "bgmv")
# Batches of at most this many tokens take BGMV. Measured on an H200 (bf16, Llama-3.1-8B
# projections, rank 16, benchmarks/lora_kernels.py, 2026-11-21): at 64 decode tokens with one
# adapter BGMV takes 11-15 us per shrink+expand and SGMV 49-50 us; at 2048 prefill tokens SGMV
# takes 48-59 us and BGMV 76-341 us. The crossover lies between; 64 is the measured safe side.
BGMV_MAX_TOKENS = 64
# The widest slot `lora_window_shrink` takes (fused LoRA kernel 1's accumulator: 128 columns).
MAX_WINDOW_RANK = 128
# A batch takes LoRAFusion's kernels (`fuses_batch`) when it has at least this many tokens per
# LoRA segment. Kernel 2's term walks the segments a row tile overlaps one after another, so a
# batch of many short segments (decode rows of several adapters) would make its tiles loop; at
# one row tile (64 tokens) a segment, a tile meets about one segment beyond its own. A bound by
# that reasoning: no other value was timed.
FUSED_MIN_SEGMENT_TOKENS = 64
_FUSED_PREFILL = envs.lora_prefill_backend() == "auto"


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta, *, variant: str | None = None
) -> torch.Tensor:
    """s[t] = x[t] @ lora_a[slot(t)].T: x [T, in], lora_a [num_slots, max_rank, in] -> s [T, max_rank].

    s is float32 whatever x's dtype (as in vLLM): it is T x max_rank, small next to x, and the
    expand then rounds once. Every row is written; rows of tokens without an adapter are zero.
    Without any adapter in the batch this returns zeros without checking or launching a kernel
    (one memset; layers should test `meta.has_lora` and skip both ops). `variant` forces the
    Triton "sgmv" or "bgmv" kernel (e.g. a fixed grid, or to measure or test Triton itself); by
    default one-token segments (decode_only) and batches of at most BGMV_MAX_TOKENS tokens take
    BGMV, the rest SGMV, and a decode_only batch's BGMV runs on the CUDA C++ extension where
    `cuda_ext.cuda_decode_wanted` says so (FLEXSERVE_LORA_DECODE_BACKEND: auto, the default, up
    to `cuda_ext.CUDA_DECODE_MAX_ROWS` tokens; cuda at any size; never with triton or without
    the extension). Raises ValueError on mismatched shapes, dtypes, devices or a last dimension
    that is not contiguous.
    """
    if not meta.has_lora:
        return torch.zeros(x.shape[0], lora_a.shape[-2], dtype=torch.float32, device=x.device)
    chosen = _variant(x, meta, variant)
    if chosen is None:
        check_shrink_args(x, lora_a, meta)
        return lora_shrink_ref(x, lora_a, meta)
    # The launchers check their inputs; checking here too would double ~3-4 us of host time.
    from flexserve_kernels.lora.serve import shrink as kernels

    if chosen == "bgmv" and variant is None and cuda_ext.cuda_decode_wanted(x.device, meta):
        return cuda_ext.lora_shrink_cuda(x, lora_a, meta.token_slots)
    if chosen == "bgmv":
        return kernels.lora_shrink_bgmv(x, lora_a, meta)
    return kernels.lora_shrink_sgmv(x, lora_a, meta)


def lora_window_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta, windows: DropoutWindows, group: int
) -> torch.Tensor:
    """`lora_shrink` with LoRA dropout on the rows of `windows` (each window's seed and p in `group`;
    other rows without): s float32 [T, max_rank] = dropout(x) @ lora_a[slot].T. The masks are never
    written: on Triton, fused LoRA kernel 1 regenerates them in registers while it streams x once
    (`lora_fused_train.lora_window_shrink_fwd`); elsewhere the reference builds them."""
    check_shrink_args(x, lora_a, meta)
    if lora_a.shape[1] > MAX_WINDOW_RANK:
        raise ValueError(f"the dropout shrink takes ranks up to {MAX_WINDOW_RANK}, got {lora_a.shape[1]}")
    if use_triton(x.device):
        from flexserve_kernels.lora.train.fused import lora_window_shrink_fwd

        return lora_window_shrink_fwd(x, lora_a, meta, windows, group)
    from flexserve_kernels.lora.train.ref import lora_window_shrink_ref

    return lora_window_shrink_ref(x, lora_a, meta, windows, group)


def fuses_batch(x: torch.Tensor, meta: LoRAKernelMeta, max_rank: int) -> bool:
    """Whether a batch's LoRA linears run as LoRAFusion's kernels (`lora_shrink_fused`, then
    `lora_linear_term` under the frozen GEMM) rather than the SGMV/BGMV pair: prefill-sized
    batches on the Triton path (more than BGMV_MAX_TOKENS tokens, not decode-only, at least
    FUSED_MIN_SEGMENT_TOKENS tokens per segment, slots up to MAX_WINDOW_RANK wide), eager or in
    a CUDA graph. Measured faster at every Llama-3.1-8B projection group from 256 to 8192 tokens on an H200
    (`benchmarks/kernels/lora_engine_forward.py`, docs/benchmarks.md). Host values only, which a
    CUDA graph's metadata fixes per bucket (its segment count is its row count)."""
    return (_FUSED_PREFILL and use_triton(x.device) and meta.has_lora and not meta.decode_only
            and meta.num_tokens > BGMV_MAX_TOKENS and max_rank <= MAX_WINDOW_RANK
            and meta.num_segments * FUSED_MIN_SEGMENT_TOKENS <= meta.num_tokens)


def lora_shrink_fused(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
    """`lora_shrink` as LoRAFusion's kernel 1 without dropout (s float32 [T, max_rank], zero rows
    for tokens without an adapter): one read of x per segment tile, its in-features split over
    the GPU's SMs. The torch reference off the Triton path."""
    if not use_triton(x.device):
        check_shrink_args(x, lora_a, meta)
        return lora_shrink_ref(x, lora_a, meta)
    from flexserve_kernels.lora.train.fused import lora_train_shrink_fwd

    return lora_train_shrink_fwd(x, lora_a, meta, None, 0, out_dtype=torch.float32)


def lora_linear_term(s: torch.Tensor, lora_b: torch.Tensor, meta: LoRAKernelMeta, scaling: torch.Tensor,
                     y: torch.Tensor) -> torch.Tensor:
    """y[t] = scaling[slot(t)] * s[t] @ lora_b[slot(t)].T written into y (not added: rows of
    tokens without an adapter become zero), for a GEMM that adds x W^T with y as its C operand:
    LoRAFusion's kernel 2 in its cuBLAS form. The torch reference off the Triton path."""
    if not use_triton(y.device):
        check_expand_args(s, lora_b, meta, y, scaling)
        return lora_expand_ref(s, lora_b, meta, y.zero_(), scaling)
    from flexserve_kernels.lora.train.fused import lora_linear_term as term

    return term(s, lora_b, meta, scaling, y)


def lora_expand(
    s: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoRAKernelMeta,
    y: torch.Tensor,
    scaling: torch.Tensor,
    *,
    variant: str | None = None,
) -> torch.Tensor:
    """y[t] += scaling[slot(t)] * s[t] @ lora_b[slot(t)].T in place; returns y.

    s [T, max_rank] float32 or y's dtype; lora_b [num_slots, out, max_rank] in y's dtype;
    y [T, out] (a column slice of a wider output is fine: only its last dimension must be
    contiguous); scaling [num_slots] float32. Rows of tokens without an adapter are not touched,
    and a batch without adapters returns at once. `variant` and the choice of kernel as in
    `lora_shrink` (the extension takes a float32 s only). Slots in the
    metadata must be < num_slots (not checked: it would need a device sync).
    """
    if not meta.has_lora:
        return y
    chosen = _variant(y, meta, variant)
    if chosen is None:
        check_expand_args(s, lora_b, meta, y, scaling)
        return lora_expand_ref(s, lora_b, meta, y, scaling)
    from flexserve_kernels.lora.serve import expand as kernels

    if (chosen == "bgmv" and variant is None and s.dtype == torch.float32
            and cuda_ext.cuda_decode_wanted(y.device, meta)):
        return cuda_ext.lora_expand_cuda(s, lora_b, meta.token_slots, y, scaling)
    if chosen == "bgmv":
        return kernels.lora_expand_bgmv(s, lora_b, meta, y, scaling)
    return kernels.lora_expand_sgmv(s, lora_b, meta, y, scaling)


def _variant(t: torch.Tensor, meta: LoRAKernelMeta, variant: str | None) -> str | None:
    """The Triton kernel to run on t's device, or None for the torch reference."""
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS} or None, got {variant!r}")
    if use_triton(t.device):
        if variant is not None:
            return variant
        return "bgmv" if meta.decode_only or meta.num_tokens <= BGMV_MAX_TOKENS else "sgmv"
    return None


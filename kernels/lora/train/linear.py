"""The fused LoRA training linear as callers use it (LoRAFusion, EuroSys'26, figure 10).

`fused_lora_linear` is the differentiable op: kernels 1-2 forward (`fused`), kernels 3-5
backward (`fused_bwd`). The forward's frozen GEMM (kernel 2) runs in the form `base_gemm` names:
"blas" (cuBLAS with the LoRA term as C), "tma" (`fused_tma`), or "auto", which times "blas"
against "tma" on a shape's first call and keeps the faster (`timed_forward_form`). The
backward's frozen GEMM (kernel 4) always runs on cuBLAS, with dX's LoRA term as its C operand.
"""

from __future__ import annotations

import torch
import triton

from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
from flexserve_kernels.lora.serve.shrink import check_launchable
from flexserve_kernels.lora.train.fused import (
    BASE_GEMMS,
    LoRATrainSlots,
    _lora_train_linear_fwd_kernel,
    check_base_gemm,
    check_train_args,
    kernel_seed,
    linear_term_tuned,
    lora_train_shrink_fwd,
    rank_block,
    token_segments,
)
from flexserve_kernels.lora.train.fused_bwd import (
    _lora_train_dx_bwd_kernel,
    dx_term_tuned,
    lora_train_da_bwd,
    lora_train_ds_db_bwd,
    lora_train_dx_term_da_bwd,
)
from flexserve_kernels.lora.train.fused_tma import linear_fwd_tma, tma_forward_runs


def base_gemm_forms(base_gemm: str, x: torch.Tensor, weight: torch.Tensor, max_rank: int) -> tuple[str, str]:
    """(forward, backward) forms of the frozen GEMMs for `fused_lora_linear`'s base_gemm: the
    backward's is always "blas"; the forward's is base_gemm, except that "auto" stays "auto" only
    where the TMA form runs (a CUDA GPU of compute capability >= 9.0, ranks up to MAX_TMA_RANK,
    16-byte rows of x, W and y: `timed_forward_form` then picks) and is "blas" elsewhere."""
    if base_gemm != "auto":
        return base_gemm, "blas"
    return ("auto" if tma_forward_runs(x, weight, max_rank) else "blas"), "blas"


_FORWARD_FORMS: dict[tuple, str] = {}
FORWARD_FORM_REPS = 4  # calls per timed batch
FORWARD_FORM_ROUNDS = 3  # batches per form, the forms alternating
_QUEUE_AHEAD_CYCLES = 4_000_000  # ~2 ms of GPU clock: the host queues a batch behind it


def timed_forward_form(x: torch.Tensor, weight: torch.Tensor, s: torch.Tensor, lora_b: torch.Tensor,
                       meta: LoRAKernelMeta, slots: LoRATrainSlots, token_segs: torch.Tensor) -> str:
    """Kernel 2's faster form here, "blas" (cuBLAS with the LoRA term as C) or "tma" (the persistent
    Triton GEMM with the term in its epilogue), as the autotuner picks tiles. The first call of each
    (device, token bucket, out, in, rank, dtype) runs each form once (their autotuning),
    then times FORWARD_FORM_ROUNDS batches of FORWARD_FORM_REPS calls per form, alternating, each
    batch between CUDA events queued behind a GPU sleep so that the events time the GPU and not the
    host's launches (torch.cuda._sleep, private but long-standing); the form of the lower best
    batch is kept, and later calls look it up: only a shape's first call synchronizes. Neither
    wins everywhere on an H100: the TMA form saves the term's write and read, but its Triton GEMM
    trails cuBLAS on some grids (docs/benchmarks.md)."""
    key = (x.device, triton.next_power_of_2(x.shape[0]), weight.shape[0], x.shape[1], lora_b.shape[2], x.dtype)
    form = _FORWARD_FORMS.get(key)
    if form is not None:
        return form
    forms = ("blas", "tma")

    def run(candidate: str) -> None:
        lora_train_linear_fwd(x, weight, s, lora_b, meta, slots, token_segs, base_gemm=candidate)

    for candidate in forms:
        run(candidate)
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(FORWARD_FORM_ROUNDS):
        for candidate in forms:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(_QUEUE_AHEAD_CYCLES)
            begin.record()
            for _ in range(FORWARD_FORM_REPS):
                run(candidate)
            end.record()
            end.synchronize()
            best[candidate] = min(best[candidate], begin.elapsed_time(end))
    form = _FORWARD_FORMS[key] = min(best, key=best.get)
    return form


def run_forms(base_gemm: str, x: torch.Tensor, weight: torch.Tensor, s: torch.Tensor, lora_b: torch.Tensor,
              meta: LoRAKernelMeta, slots: LoRATrainSlots, token_segs: torch.Tensor) -> tuple[str, str]:
    """The (forward, backward) forms that `fused_lora_linear` runs for base_gemm here:
    `base_gemm_forms`, with an "auto" forward settled by `timed_forward_form` (given kernel 1's S)."""
    forward, backward = base_gemm_forms(base_gemm, x, weight, lora_b.shape[2])
    if forward == "auto":
        forward = timed_forward_form(x, weight, s, lora_b, meta, slots, token_segs)
    return forward, backward


def lora_train_linear_fwd(x: torch.Tensor, weight: torch.Tensor, s: torch.Tensor, lora_b: torch.Tensor,
                          meta: LoRAKernelMeta, slots: LoRATrainSlots, token_segs: torch.Tensor,
                          *, base_gemm: str = "blas", blocks: tuple[int, int, int] | None = None,
                          autotune: bool | None = None) -> torch.Tensor:
    """Kernel 2: y [T, out] = x W^T + scaling[slot] * S B[slot]^T, one pass over y.

    base_gemm "blas": the kernel writes the LoRA term (zero rows for tokens without an adapter)
    and `addmm_` adds x W^T to it in torch's GEMM; "tma": `fused_tma.linear_fwd_tma`. The tiles
    are autotuned (the configs file's candidates) when `autotune` (default: on CUDA),
    else `blocks` = (BLOCK_M, BLOCK_N, BLOCK_K), small ones by default (the interpreter's tests).
    """
    check_base_gemm(base_gemm)
    check_launchable(x, _lora_train_linear_fwd_kernel)
    num_tokens, in_size = x.shape
    out_size, max_rank = lora_b.shape[1], lora_b.shape[2]
    y = torch.empty(num_tokens, out_size, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return y
    if base_gemm == "tma":
        linear_fwd_tma(x, weight, s, lora_b, y, token_segs, meta, slots, blocks=None if autotune else blocks)
        return y
    args = (s, lora_b, y, meta.token_slots, token_segs, meta.seg_starts, meta.seg_lens, meta.seg_slots,
            slots.scalings, num_tokens, out_size, max_rank, triton.next_power_of_2(num_tokens),
            s.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0))
    if autotune if autotune is not None else x.device.type == "cuda" and blocks is None:
        grid = lambda c: (triton.cdiv(num_tokens, c["BLOCK_M"]) * triton.cdiv(out_size, c["BLOCK_N"]),)  # noqa: E731
        linear_term_tuned(x.device)[grid](*args, BLOCK_R=rank_block(max_rank))
    else:
        block_m, block_n, block_k = blocks or (16, 32, 32)
        grid = (triton.cdiv(num_tokens, block_m) * triton.cdiv(out_size, block_n),)
        _lora_train_linear_fwd_kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                            BLOCK_R=rank_block(max_rank), GROUP_M=4, num_warps=4, num_stages=3)
    return y.addmm_(x, weight.t())


def lora_train_dx_bwd(dy: torch.Tensor, weight: torch.Tensor, ds: torch.Tensor, lora_a: torch.Tensor,
                      meta: LoRAKernelMeta, slots: LoRATrainSlots, token_segs: torch.Tensor, seed: int,
                      *, blocks: tuple[int, int, int] | None = None, autotune: bool | None = None) -> torch.Tensor:
    """Kernel 4: dX [T, in] = dY W + dropout'(dS A[slot]): the kernel writes the LoRA term and
    `addmm_` adds dY W to it in torch's GEMM; autotuned (the configs file's candidates) when `autotune`
    (default: on CUDA), else `blocks` = (BLOCK_M, BLOCK_N over in, BLOCK_K unused)."""
    check_launchable(dy, _lora_train_dx_bwd_kernel)
    num_tokens, out_size = dy.shape
    in_size = weight.shape[1]
    max_rank = lora_a.shape[1]
    dx = torch.empty(num_tokens, in_size, dtype=dy.dtype, device=dy.device)
    if num_tokens == 0:
        return dx
    args = (ds, lora_a, dx, token_segs, meta.seg_starts, meta.seg_lens, meta.seg_slots, slots.dropout_ps,
            num_tokens, in_size, max_rank, kernel_seed(seed), triton.next_power_of_2(num_tokens),
            ds.stride(0), lora_a.stride(0), lora_a.stride(1), dx.stride(0))
    if autotune if autotune is not None else dy.device.type == "cuda" and blocks is None:
        grid = lambda c: (triton.cdiv(num_tokens, c["BLOCK_M"]) * triton.cdiv(in_size, c["BLOCK_N"]),)  # noqa: E731
        dx_term_tuned(dy.device)[grid](*args, HAS_DROPOUT=slots.has_dropout, SPLIT_DS=False,
                                       BLOCK_R=rank_block(max_rank))
    else:
        block_m, block_n, block_k = blocks or (16, 32, 32)
        grid = (triton.cdiv(num_tokens, block_m) * triton.cdiv(in_size, block_n),)
        _lora_train_dx_bwd_kernel[grid](*args, HAS_DROPOUT=slots.has_dropout, SPLIT_DS=False, BLOCK_M=block_m,
                                        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=rank_block(max_rank), GROUP_M=4,
                                        num_warps=4, num_stages=3)
    return dx.addmm_(dy, weight)


class FusedLoRALinearFunction(torch.autograd.Function):
    """y = x W^T + scaling * dropout(x) A^T B^T per token's adapter slot; W frozen.

    Forward runs kernels 1-2 and keeps x and S; backward runs kernels 3-5 and returns dX, dA, dB.
    """

    @staticmethod
    def forward(ctx, x, weight, lora_a, lora_b, meta, slots, seed, base_gemm):
        token_segs = token_segments(meta)
        s = lora_train_shrink_fwd(x, lora_a, meta, slots, seed)
        fwd_gemm, _ = run_forms(base_gemm, x, weight, s, lora_b, meta, slots, token_segs)
        y = lora_train_linear_fwd(x, weight, s, lora_b, meta, slots, token_segs, base_gemm=fwd_gemm)
        ctx.save_for_backward(x, weight, lora_a, lora_b, s, token_segs)
        ctx.meta, ctx.slots, ctx.seed = meta, slots, seed
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, lora_a, lora_b, s, token_segs = ctx.saved_tensors
        meta, slots, seed = ctx.meta, ctx.slots, ctx.seed
        dy = dy.contiguous()
        ds, db = lora_train_ds_db_bwd(dy, lora_b, s, meta, slots)
        if ctx.needs_input_grad[0]:
            # dX's LoRA term and dA in one pass over the [T, in] tiles; the GEMM adds dY W to it
            term, da = lora_train_dx_term_da_bwd(x, ds, lora_a, meta, slots, seed)
            return term.addmm_(dy, weight), None, da, db, None, None, None, None
        da = lora_train_da_bwd(x, ds, lora_a, meta, slots, seed)
        return None, None, da, db, None, None, None, None


def fused_lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      meta: LoRAKernelMeta, slots: LoRATrainSlots, seed: int, *,
                      base_gemm: str = "auto") -> torch.Tensor:
    """Differentiable fused LoRA linear over x [..., in] (tokens flattened in order for meta).

    weight [out, in] is frozen (ValueError if it requires grad); lora_a [slots, r_max, in] and
    lora_b [slots, out, r_max] hold each slot's adapter zero-padded to r_max; seed in [0, 2**31)
    fixes the dropout mask, regenerated in backward. base_gemm picks where the forward's frozen
    GEMM runs ("blas": torch's GEMM with the LoRA term as its C operand; "tma"; "auto":
    `base_gemm_forms`); the backward's runs on torch's GEMM.
    """
    check_base_gemm(base_gemm, BASE_GEMMS + ("auto",))
    if weight.requires_grad:
        raise ValueError("the base weight must be frozen (requires_grad=False) for the fused LoRA linear")
    if not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2**31), got {seed}")
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    check_train_args(flat, weight, lora_a, lora_b, meta, slots)
    y = FusedLoRALinearFunction.apply(flat, weight, lora_a, lora_b, meta, slots, seed, base_gemm)
    return y.reshape(*x.shape[:-1], weight.shape[0])

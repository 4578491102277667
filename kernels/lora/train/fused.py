"""Fused LoRA training forward (LoRAFusion, EuroSys'26, figure 10a) for one or many adapters.

The graph is split at S = dropout(x) A^T, the [T, r] tensor that is cheap to store:
  kernel 1 (`lora_train_shrink_fwd`): S, dropout fused into the shrink's loads, x read once, in_size
  split over programs (split-K) with each row tile's partials summed in a fixed order (no float
  atomics: reproducible);
  kernel 2 (`lora_train_linear_fwd`): y = x W^T + scaling * S B^T in one pass over y: each y tile
  adds its [tile_m, r] x [r, tile_n] LoRA product to the base GEMM's accumulator before its one
  store (no separate expand reading and writing y again).
Kernel 2 has two forms (`base_gemm`). "blas": the Triton kernel writes only the LoRA term, and
torch's GEMM (cuBLAS on CUDA) computes x W^T with that term as its C operand (beta = 1, `addmm_`),
so the term is read in cuBLAS's epilogue and the compute-bound GEMM keeps cuBLAS's tiling; the
cost over the plain GEMM is one write of the term. "tma" (`fused_tma`): LoRAFusion's literal
form on Hopper, a persistent Triton GEMM over TMA with the LoRA product in its epilogue, no term
through memory. `fused_lora_linear`'s default, "auto", times "blas" and "tma" on the first
call of each shape and keeps the faster (`timed_forward_form`).
Dropout is never stored: the keep mask is a counter-based hash of (seed, token, column), and the
backward (`fused_bwd`) regenerates it. Adapters are routed per token: a y row tile whose
rows all have one slot (the usual tile) adds its product in one dot, and one whose rows differ
loops over meta's segments it overlaps, masking S's rows to each segment, so tiles may straddle
adapters and tokens without one get the base only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flexserve_kernels.lora.dropout_hash import (
    HASH_COLUMN,
    HASH_MIX1,
    HASH_MIX2,
    HASH_TOKEN,
    mix32_ref,
)
from flexserve_kernels.lora.serve.meta import DropoutWindows, LoRAKernelMeta
from flexserve_kernels.lora.serve.shrink import check_launchable, target_programs
from flexserve_kernels.lora.train.configs import CONFIGS_DIR, train_configs
from flexserve_kernels.tuned_configs import by_rank, device_name, load_configs

_HASH_TOKEN = tl.constexpr(HASH_TOKEN)
_HASH_COLUMN = tl.constexpr(HASH_COLUMN)
_HASH_MIX1 = tl.constexpr(HASH_MIX1)
_HASH_MIX2 = tl.constexpr(HASH_MIX2)


@dataclass(slots=True)
class LoRATrainSlots:
    """Per-slot LoRA training hyperparameters, on the device, plus what the host must know."""

    scalings: torch.Tensor  # [num_slots] float32: alpha / rank of each slot's adapter
    dropout_ps: torch.Tensor  # [num_slots] float32: dropout probability of each slot, in [0, 1)
    has_dropout: bool  # any slot has dropout p > 0 (host side: picks the kernels' dropout branch)

    @property
    def num_slots(self) -> int:
        return int(self.scalings.shape[0])

    @classmethod
    def build(cls, scalings: list[float], dropout_ps: list[float], device: torch.device | str) -> "LoRATrainSlots":
        """From host lists, one entry per slot; dropout p must lie in [0, 1)."""
        if len(scalings) != len(dropout_ps):
            raise ValueError(f"{len(scalings)} scalings for {len(dropout_ps)} dropout probabilities")
        for p in dropout_ps:
            if not 0.0 <= p < 1.0:
                raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        as_tensor = lambda v: torch.tensor(v, dtype=torch.float32).to(device)  # noqa: E731
        return cls(as_tensor(scalings), as_tensor(dropout_ps), any(p > 0 for p in dropout_ps))


def kernel_seed(seed: int) -> int:
    """A dropout seed in [0, 2**32) as the kernels take it: the int32 with the same 32 bits.
    Triton types an integer argument by its value (int32 below 2**31, int64 above) and compiles
    a kernel variant per type, which `do_not_specialize` does not prevent: raw window seeds,
    half of them 2**31 or more, compiled a second variant in the middle of a job. The kernels'
    hash adds the seed mod 2**32, so the wrapped value gives the same bits."""
    return seed - (1 << 32) if seed >= 1 << 31 else seed


@triton.jit
def keep_threshold(p):
    """The integer form of dropout probability p for `dropout_keep`: ceil(p * 2**24). The
    reference keeps an element when (h >> 8) * 2**-24 >= p, both sides exact in fp32, which is
    (h >> 8) >= ceil(p * 2**24): one integer compare per element instead of a convert and a multiply."""
    return tl.ceil(p * 16777216.0).to(tl.uint32)


@triton.jit
def mix32(h):
    """`mix32_ref` on uint32 values (their products wrap mod 2**32)."""
    h = h ^ (h >> 16)
    h = h * _HASH_MIX1
    h = h ^ (h >> 15)
    h = h * _HASH_MIX2
    return h ^ (h >> 16)


@triton.jit
def dropout_keep(seed, rows, cols, threshold):
    """[rows, cols] keep mask of dropout with `keep_threshold(p)` (same bits as dropout_keep_ref:
    mixed keys per row and per column, then per element one xor, multiply and xor-shift).
    Callers scale what they accumulate by 1 / (1 - p) once, not every kept element."""
    # seed is added last: Triton may pass a seed of 1 as a constant, which has no .to(). A seed of
    # 2**31 or more arrives as int64, so the sum is cast back to 32 bits (mod 2**32, as the reference).
    row_keys = mix32((rows.to(tl.uint32) * _HASH_TOKEN + seed).to(tl.uint32))
    col_keys = mix32(cols.to(tl.uint32) * _HASH_COLUMN)
    h = (row_keys[:, None] ^ col_keys[None, :]) * _HASH_MIX1
    h = h ^ (h >> 16)
    return (h >> 8) >= threshold


@triton.jit
def shrink_keep(row_keys, col_keys, threshold_hi):
    """`dropout_keep` from the mixed keys of its rows and columns (the same bits), for the shrink,
    which hoists the row keys out of its K loop: threshold_hi is keep_threshold(p) << 8, so an
    element's (h >> 8) >= threshold is h >= threshold_hi, one op fewer per element. Exact: an fp32
    p < 1 makes p * 2**24 an integer-valued fp32 <= 2**24 - 1, so the shifted threshold fits 32 bits."""
    h = (row_keys[:, None] ^ col_keys[None, :]) * _HASH_MIX1
    return (h ^ (h >> 16)) >= threshold_hi


@triton.jit
def _shrink_store(s_ptr, acc, first_row, scale, offs_m, offs_r, m_mask, r_mask, stride_sm,
                  HAS_DROPOUT: tl.constexpr):
    if HAS_DROPOUT:
        acc = acc * scale  # dropout's 1 / (1 - p) (a scalar, or per row [BLOCK_M, 1]), once per S element
    s_ptrs = s_ptr + first_row.to(tl.int64) * stride_sm + offs_m[:, None] * stride_sm + offs_r[None, :]
    tl.store(s_ptrs, acc.to(s_ptr.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def window_dropout(rows, win_bounds_ptr, win_table_ptr, num_windows, win_group, BLOCK_M: tl.constexpr):
    """(seed, p) of each row from the dropout windows (`DropoutWindows`) of group win_group: the
    window's entry for the rows inside it, (0, 0.0) outside every window (dropout keeps them all)."""
    row_seeds = tl.zeros((BLOCK_M,), dtype=tl.uint32)
    row_ps = tl.zeros((BLOCK_M,), dtype=tl.float32)
    entry = win_table_ptr + win_group * num_windows * 2
    for w in range(num_windows):
        first = tl.load(win_bounds_ptr + 2 * w)
        inside = (rows >= first) & (rows < first + tl.load(win_bounds_ptr + 2 * w + 1))
        row_seeds = tl.where(inside, tl.load(entry + 2 * w).to(tl.uint32, bitcast=True), row_seeds)
        row_ps = tl.where(inside, tl.load(entry + 2 * w + 1).to(tl.float32, bitcast=True), row_ps)
    return row_seeds, row_ps


@triton.jit(do_not_specialize=["num_splits", "num_windows", "win_group"])
def _lora_train_shrink_fwd_kernel(
    x_ptr, a_ptr, s_ptr, part_ptr, count_ptr, keys_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
    dropout_ps_ptr, win_bounds_ptr, win_table_ptr, in_size, max_rank, seed, m_bucket, k_per_split, num_splits,
    num_windows, win_group, stride_xm, stride_as, stride_ar, stride_sm, stride_ps,
    HAS_DROPOUT: tl.constexpr, SPLIT: tl.constexpr, KEY_TABLE: tl.constexpr, ROW_WINDOWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Grid: (segment, row tile of the segment, split of in_size when SPLIT); tiles past a
    # segment's end exit. m_bucket (next power of two of the token count) is only the autotuner's
    # key. With SPLIT, each program writes its fp32 partial [BLOCK_M, r] of columns
    # [split * k_per_split, +k_per_split) to part (rows indexed by token), then counts itself in
    # on the tile's counter (count_ptr at the tile's first row); the last of the tile's num_splits
    # programs sums the partials in split order (whatever order they finished in: reproducible),
    # resets the counter to 0 for the next launch, and stores S.
    # Dropout's seed and p come from the slot's p and the launch's seed, or with ROW_WINDOWS from
    # the row's window (`window_dropout`: the fine-tuning engine's windows, p per window and target).
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    first_row = tl.load(seg_starts_ptr + seg) + pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < seg_len - pid_m * BLOCK_M
    r_mask = offs_r < max_rank
    if SPLIT:
        k_begin = tl.program_id(2) * k_per_split
        k_stop = tl.minimum(in_size, k_begin + k_per_split)
    else:
        k_begin = 0
        k_stop = in_size
    # 64-bit scalar bases, 32-bit offsets within the tile (fewer registers than int64 offsets).
    x_base = x_ptr + first_row.to(tl.int64) * stride_xm + k_begin
    x_offs = offs_m[:, None] * stride_xm + offs_k[None, :]
    # lora_a[slot] is [max_rank, in]; read as its transpose [BLOCK_K, BLOCK_R] for the dot.
    a_base = a_ptr + slot * stride_as + k_begin
    a_offs = offs_r[None, :] * stride_ar + offs_k[:, None]
    scale = 1.0
    if HAS_DROPOUT:
        if ROW_WINDOWS:
            row_seeds, row_ps = window_dropout(first_row + offs_m, win_bounds_ptr, win_table_ptr, num_windows,
                                               win_group, BLOCK_M)
            threshold_hi = (keep_threshold(row_ps) << 8)[:, None]
            scale = (1.0 / (1.0 - row_ps))[:, None]
            row_keys = mix32((first_row + offs_m).to(tl.uint32) * _HASH_TOKEN + row_seeds)
        else:
            p = tl.load(dropout_ps_ptr + slot)
            threshold_hi = keep_threshold(p) << 8
            scale = 1.0 / (1.0 - p)
            # As in `dropout_keep`: seed added last, the sum cast back to 32 bits (seeds >= 2**31).
            row_keys = mix32(((first_row + offs_m).to(tl.uint32) * _HASH_TOKEN + seed).to(tl.uint32))
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_begin, k_stop, BLOCK_K):
        k_mask = offs_k < k_stop - k
        x_tile = tl.load(x_base + x_offs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if HAS_DROPOUT:
            if KEY_TABLE:  # the column keys, mixed once per device (`column_keys`)
                col_keys = tl.load(keys_ptr + k + offs_k, mask=k_mask, other=0).to(tl.uint32, bitcast=True)
            else:
                col_keys = mix32((k + offs_k).to(tl.uint32) * _HASH_COLUMN)
            x_tile = tl.where(shrink_keep(row_keys, col_keys, threshold_hi), x_tile, 0.0)
        a_tile = tl.load(a_base + a_offs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(x_tile, a_tile, acc, input_precision="ieee")
        x_base += BLOCK_K
        a_base += BLOCK_K
    if SPLIT:
        # part is [num_splits, T, max_rank] fp32, contiguous.
        part_offs = first_row.to(tl.int64) * max_rank + offs_m[:, None] * max_rank + offs_r[None, :]
        rm_mask = m_mask[:, None] & r_mask[None, :]
        tl.store(part_ptr + tl.program_id(2).to(tl.int64) * stride_ps + part_offs, acc, mask=rm_mask)
        # Every thread's partial stores before the counter's release (one thread issues the
        # scalar atomic), as CUTLASS's split-K semaphore does.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + first_row, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            # .cg: read the other programs' partials from L2, never a stale L1 line.
            part_ptrs = part_ptr + part_offs
            acc = tl.load(part_ptrs, mask=rm_mask, other=0.0, cache_modifier=".cg")
            for _ in range(1, num_splits):
                part_ptrs += stride_ps
                acc += tl.load(part_ptrs, mask=rm_mask, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + first_row, 0)  # ready for the next launch (cached counters)
            _shrink_store(s_ptr, acc, first_row, scale, offs_m, offs_r, m_mask, r_mask, stride_sm, HAS_DROPOUT)
    else:
        _shrink_store(s_ptr, acc, first_row, scale, offs_m, offs_r, m_mask, r_mask, stride_sm, HAS_DROPOUT)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` in grouped order: GROUP_M row tiles share each
    column tile of the weight while it is in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_id = pid // (GROUP_M * num_pid_n)
    first_m = group_id * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
    return pid_m, pid_n


@triton.jit
def tile_segments(token_segs_ptr, rows, num_rows):
    """[first, end) of the segments that rows (sorted, a tile) overlap; empty when none."""
    segs = tl.load(token_segs_ptr + rows, mask=rows < num_rows, other=-1)
    first = tl.min(tl.where(segs >= 0, segs, 2147483647), axis=0)
    end = tl.max(segs, axis=0) + 1
    return first, end


@triton.jit
def tile_slot(token_slots_ptr, rows, num_rows):
    """The adapter slot of every row of a tile (rows past num_rows left out): the slot when they
    all have the same one, -1 when none has one, -2 when they differ."""
    valid = rows < num_rows
    slots = tl.load(token_slots_ptr + rows, mask=valid, other=0)
    lowest = tl.min(tl.where(valid, slots, 2147483647), axis=0)
    highest = tl.max(tl.where(valid, slots, -2147483647), axis=0)
    return tl.where(lowest == highest, lowest, -2)


@triton.jit
def add_lora_fwd_term(acc, rows, cols, M, N, s_ptr, b_ptr, token_slots_ptr, token_segs_ptr, seg_starts_ptr,
                      seg_lens_ptr, seg_slots_ptr, scalings_ptr, max_rank, stride_sm, stride_bs, stride_bn,
                      BLOCK_R: tl.constexpr):
    """acc [rows, cols] + scaling * S B^T of each row's adapter (kernel 2's epilogue, the same in
    every form of it). A tile whose rows share one slot adds one product after one load of its
    rows' slots. A mixed tile walks the segments it overlaps, reading each one's start, length and
    slot in turn: a chain of dependent loads after the main loop, which cost the TMA form about
    1.7% of the base GEMM at 4096 x 4096 and 2048 x 4096 when every tile took it (the same tiles
    before and after; docs/benchmarks.md)."""
    slot = tile_slot(token_slots_ptr, rows, M)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < max_rank
    if slot >= 0:
        s_tile = _s_tile(s_ptr, rows, M, offs_r, r_mask, stride_sm)
        acc = _add_slot_product(acc, s_tile * tl.load(scalings_ptr + slot), b_ptr, slot, cols, N, offs_r, r_mask,
                                stride_bs, stride_bn)
    if slot == -2:
        seg_first, seg_end = tile_segments(token_segs_ptr, rows, M)
        s_tile = _s_tile(s_ptr, rows, M, offs_r, r_mask, stride_sm)
        for seg in range(seg_first, seg_end):
            start = tl.load(seg_starts_ptr + seg)
            in_seg = (rows >= start) & (rows < start + tl.load(seg_lens_ptr + seg))
            seg_slot = tl.load(seg_slots_ptr + seg)
            scaled = tl.where(in_seg[:, None], s_tile * tl.load(scalings_ptr + seg_slot), 0.0)
            acc = _add_slot_product(acc, scaled, b_ptr, seg_slot, cols, N, offs_r, r_mask, stride_bs, stride_bn)
    return acc


@triton.jit
def _s_tile(s_ptr, rows, M, offs_r, r_mask, stride_sm):
    """S's [rows, BLOCK_R] tile in fp32 (zeros past M and past the rank)."""
    return tl.load(s_ptr + rows.to(tl.int64)[:, None] * stride_sm + offs_r[None, :],
                   mask=(rows < M)[:, None] & r_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _add_slot_product(acc, scaled_s, b_ptr, slot, cols, N, offs_r, r_mask, stride_bs, stride_bn):
    """acc + scaled_s [rows, BLOCK_R] x B[slot]^T [BLOCK_R, cols]."""
    # lora_b[slot] is [out, max_rank]; read as its transpose [BLOCK_R, BLOCK_N].
    b_tile = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + cols.to(tl.int64)[None, :] * stride_bn + offs_r[:, None],
                     mask=r_mask[:, None] & (cols < N)[None, :], other=0.0)
    return tl.dot(scaled_s.to(b_tile.dtype), b_tile, acc, input_precision="ieee")


@triton.jit
def _lora_train_linear_fwd_kernel(
    s_ptr, b_ptr, y_ptr, token_slots_ptr, token_segs_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
    scalings_ptr, M, N, max_rank, m_bucket, stride_sm, stride_bs, stride_bn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # The LoRA term of kernel 2's "blas" form: x W^T is added in cuBLAS (`addmm_`). m_bucket (next
    # power of two of M) is only the autotuner's key; BLOCK_K is unused (the configs' shared form).
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rows < M
    n_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = add_lora_fwd_term(acc, rows, cols, M, N, s_ptr, b_ptr, token_slots_ptr, token_segs_ptr, seg_starts_ptr,
                            seg_lens_ptr, seg_slots_ptr, scalings_ptr, max_rank, stride_sm, stride_bs, stride_bn,
                            BLOCK_R)
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def term_tiles(op: str, max_rank: int, device: torch.device, blocks: tuple[int, int] | None = None,
               num_warps: int | None = None) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps) of a LoRA term launcher with fixed tiles (configs `op`,
    `by_rank`), `blocks` and `num_warps` overriding them; small tiles on the CPU (the
    interpreter's tests)."""
    if device.type != "cuda":
        return 16, 32, 4
    tuned = by_rank(train_configs(device)[op]["by_rank"], max_rank)
    block_m, block_n = blocks or (tuned["block_m"], tuned["block_n"])
    return block_m, block_n, num_warps or tuned["num_warps"]


def lora_linear_term(s: torch.Tensor, lora_b: torch.Tensor, meta: LoRAKernelMeta, scalings: torch.Tensor,
                     y: torch.Tensor, *, blocks: tuple[int, int] | None = None,
                     num_warps: int | None = None) -> torch.Tensor:
    """Kernel 2's LoRA term alone, written into y [T, out] (a column slice of a wider output is
    fine): y[t] = scalings[slot(t)] * S[t] B[slot(t)]^T, zero rows for tokens without an adapter,
    for a caller whose GEMM then adds x W^T with y as its C operand (`addmm_`: kernel 2's "blas"
    form). s [T, max_rank] (fp32 or y's dtype), lora_b [slots, out, max_rank] (any row strides),
    scalings [slots] float32. Fixed tiles (by rank, configs `lora_linear_term`), no autotuning:
    the engine calls this with every batch size, in CUDA graph captures too, and must not stop to
    tune."""
    check_launchable(s, _lora_train_linear_fwd_kernel)
    num_tokens, (out_size, max_rank) = s.shape[0], lora_b.shape[1:]
    if s.shape[1] != max_rank or s.stride(1) != 1 or lora_b.stride(2) != 1 or y.stride(1) != 1:
        raise ValueError(f"S must be [T, {max_rank}] and lora_b and y contiguous in their last dimension")
    if tuple(y.shape) != (num_tokens, out_size):
        raise ValueError(f"y must be [{num_tokens}, {out_size}], got {tuple(y.shape)}")
    if num_tokens == 0:
        return y
    if not meta.has_lora:
        return y.zero_()
    block_m, block_n, num_warps = term_tiles("lora_linear_term", max_rank, s.device, blocks, num_warps)
    grid = (triton.cdiv(num_tokens, block_m) * triton.cdiv(out_size, block_n),)
    _lora_train_linear_fwd_kernel[grid](
        s, lora_b, y, meta.token_slots, token_segments(meta), meta.seg_starts, meta.seg_lens, meta.seg_slots,
        scalings, num_tokens, out_size, max_rank, triton.next_power_of_2(num_tokens), s.stride(0),
        lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=16, BLOCK_R=rank_block(max_rank), GROUP_M=4,
        num_warps=num_warps, num_stages=1,
    )
    return y


def gemm_configs(candidates: list[dict], extras: tuple[str, ...] = ()) -> list[triton.Config]:
    """triton.Configs of a configs file's candidates (block_m, block_n, block_k, num_warps,
    num_stages, then the constexprs named in `extras` in upper case), grouped 8 row tiles."""
    return [triton.Config({"BLOCK_M": c["block_m"], "BLOCK_N": c["block_n"], "BLOCK_K": c["block_k"], "GROUP_M": 8,
                           **{name.upper(): c[name] for name in extras}},
                          num_warps=c["num_warps"], num_stages=c["num_stages"])
            for c in candidates]


def prune_by_rank(configs, named_args, wide_rank_candidates: int = 1, **kwargs):
    """The term kernels' autotuner `early_config_prune`: above rank 32, only the first
    `wide_rank_candidates` candidates (the others spill there: ptxas, sm_90, triton 3.9, bf16)."""
    return configs if named_args["max_rank"] <= 32 else configs[:wide_rank_candidates]


def term_tuner(kernel, settings: dict):
    """`kernel` autotuned over a term operation's candidates (the LoRA term alone, base_gemm="blas":
    no main loop, so the tile only sets how the one store is spread over the GPU)."""
    prune = functools.partial(prune_by_rank, wide_rank_candidates=settings["wide_rank_candidates"])
    return triton.autotune(configs=gemm_configs(settings["candidates"]), key=["m_bucket", "N", "max_rank"],
                           prune_configs_by={"early_config_prune": prune})(kernel)


@functools.cache
def _linear_term_tuner(name: str | None):
    return term_tuner(_lora_train_linear_fwd_kernel, load_configs(CONFIGS_DIR, name)["lora_train_linear_fwd_term"])


def linear_term_tuned(device: torch.device):
    """Kernel 2's LoRA term autotuned over the candidates of device's configs file (one autotuner
    per GPU name)."""
    return _linear_term_tuner(device_name(device))


BASE_GEMMS = ("blas", "tma")


def check_base_gemm(base_gemm: str, choices: tuple[str, ...] = BASE_GEMMS) -> None:
    """ValueError unless base_gemm is one of `choices`."""
    if base_gemm not in choices:
        raise ValueError(f"base_gemm must be one of {choices}, got {base_gemm!r}")


def token_segments(meta: LoRAKernelMeta) -> torch.Tensor:
    """[T] int32: each token's segment index in meta, -1 for tokens without an adapter (no sync);
    built once per meta (`meta.token_segs`) and shared by every layer of the step."""
    if meta.token_segs is not None:
        return meta.token_segs
    tokens = torch.arange(meta.num_tokens, dtype=torch.int32, device=meta.token_slots.device)
    if meta.num_segments == 0:
        meta.token_segs = torch.full_like(tokens, -1)
        return meta.token_segs
    seg = torch.searchsorted(meta.seg_starts, tokens, right=True).to(torch.int32) - 1
    clamped = seg.clamp(min=0).long()
    inside = (seg >= 0) & (tokens < meta.seg_starts[clamped] + meta.seg_lens[clamped])
    meta.token_segs = torch.where(inside, seg, -1)
    return meta.token_segs


def check_train_args(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     meta: LoRAKernelMeta, slots: LoRATrainSlots) -> None:
    """Shapes, contiguity and devices the kernels rely on; ValueError otherwise."""
    if x.dim() != 2 or weight.dim() != 2 or lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError("x [T, in], weight [out, in], lora_a [slots, r, in], lora_b [slots, out, r] expected")
    num_tokens, in_size = x.shape
    out_size = weight.shape[0]
    num_slots, max_rank = lora_a.shape[:2]
    if weight.shape[1] != in_size or lora_a.shape[2] != in_size:
        raise ValueError(f"in sizes differ: x {in_size}, weight {weight.shape[1]}, lora_a {lora_a.shape[2]}")
    if tuple(lora_b.shape) != (num_slots, out_size, max_rank):
        raise ValueError(f"lora_b must be {(num_slots, out_size, max_rank)}, got {tuple(lora_b.shape)}")
    if max_rank < 1 or max_rank > 128:
        raise ValueError(f"max rank must be in [1, 128], got {max_rank}")
    if slots.num_slots != num_slots:
        raise ValueError(f"{slots.num_slots} slot configs for {num_slots} adapter slots")
    if meta.num_tokens != num_tokens:
        raise ValueError(f"meta has {meta.num_tokens} tokens, x has {num_tokens}")
    for name, t in (("x", x), ("weight", weight), ("lora_a", lora_a), ("lora_b", lora_b)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if len({x.dtype, weight.dtype, lora_a.dtype, lora_b.dtype}) != 1:
        raise ValueError("x, weight, lora_a and lora_b must share one dtype")


def rank_block(max_rank: int) -> int:
    # tl.dot needs every dimension >= 16: smaller ranks are padded (masked) to 16.
    return max(16, triton.next_power_of_2(max_rank))


# Kernel 1 on CUDA (`lora_train_shrink_fwd`'s defaults, "lora_train_shrink_fwd" in the configs
# file): row tiles of block_m tokens and block_k columns per step, split over in_size until about
# per_sm programs per SM, column keys loaded from `column_keys` (key_table). Small row tiles leave
# several programs resident per SM, which hide the latency of the instruction-bound dropout hash.


def shrink_warps(block_m: int, max_rank: int, row_windows: bool = False) -> int:
    """Kernel 1's CUDA warps: 8 for accumulators over 4096 elements (64 rows at rank 64 up), else 4;
    with row windows (per-row seeds, thresholds and scales) already at 4096 (32 rows at rank 128).
    ptxas (sm_90, triton 3.9, bf16, dropout, 128-column steps): 32 rows at 4 warps take 84 registers
    at rank 16 and 132 at 128, where 8 warps spill; 64 rows at rank 128 take 179 at 8 warps; with row
    windows, 32 rows at rank 128 spill 32 bytes at 4 warps."""
    return 8 if block_m * rank_block(max_rank) > (2048 if row_windows else 4096) else 4


def shrink_split_plan(meta: LoRAKernelMeta, in_size: int, max_rank: int, block_m: int, block_k: int,
                      device: torch.device, per_sm: int, num_splits: int | None = None) -> tuple[int, int]:
    """(k_per_split, num_splits) of kernel 1: in_size in num_splits chunks of k_per_split columns
    (a multiple of block_k). Unless given, num_splits is what brings the row tiles to about
    `target_programs(device, per_sm)` programs, capped so the fp32 partials (num_splits x T x r x 4
    bytes, written then read once) stay within an eighth of x's 16-bit bytes."""
    k_blocks = triton.cdiv(in_size, block_k)
    if num_splits is None:
        # Row tiles that run (the grid's others exit at once): each segment's, bounded by the tokens.
        tiles = min(meta.num_segments * triton.cdiv(meta.max_seg_len, block_m),
                    triton.cdiv(meta.num_tokens, block_m) + meta.num_segments - 1)
        num_splits = min(target_programs(device, per_sm) // max(1, tiles), in_size // (16 * max_rank))
    num_splits = max(1, min(num_splits, k_blocks))
    k_per_split = triton.cdiv(k_blocks, num_splits) * block_k
    return k_per_split, triton.cdiv(in_size, k_per_split)


_SCRATCH: dict[tuple[str, torch.device, int, torch.dtype], torch.Tensor] = {}


def current_stream_handle(device: torch.device) -> int:
    """The current CUDA stream's handle on device (0 on CPU): `launch_scratch`'s key, asked the
    way Triton's launcher asks it (a raw handle, no torch Stream object built)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.get_current_stream(index)


def launch_scratch(owner: str, device: torch.device, count: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A kernel's scratch buffer of at least `count` elements (`owner`: "shrink", kernel 1's
    split counters by token; "tma_tail" and "tma_tail_parts", kernel 2's tail-split counters by
    tile and fp32 partial tiles), zeroed once and cached per owner, device, stream and dtype, so a
    launch allocates nothing: launches on one stream never overlap, and counters stay zero between
    launches because the last program of each split resets its own.

    Inside a CUDA graph capture, a buffer of the graph's own (zeroed by each replay): a zero fill
    issued during a capture is recorded, not run, so a cached buffer first made there would hold
    garbage for every other launch; and graphs replayed on different streams must not share
    counters."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=dtype, device=device)
    key = (owner, device, current_stream_handle(device), dtype)
    buffer = _SCRATCH.get(key)
    if buffer is None or buffer.numel() < count:
        buffer = torch.zeros(max(1024, triton.next_power_of_2(count)), dtype=dtype, device=device)
        _SCRATCH[key] = buffer
    return buffer


_COLUMN_KEYS: dict[torch.device, torch.Tensor] = {}


def column_keys(device: torch.device, in_size: int) -> torch.Tensor:
    """[>= in_size] int32: the dropout hash's mixed column keys (mix32(col * HASH_COLUMN), the bits
    of `dropout_keep`'s col_keys; independent of the seed), computed once per device and grown to
    the widest in_size seen, so the shrink loads them instead of mixing them per tile."""
    keys = _COLUMN_KEYS.get(device)
    if keys is None or keys.numel() < in_size:
        cols = torch.arange(max(4096, triton.next_power_of_2(in_size)), dtype=torch.int64, device=device)
        mixed = mix32_ref((cols * HASH_COLUMN) & 0xFFFFFFFF)
        keys = torch.where(mixed >= 2**31, mixed - 2**32, mixed).to(torch.int32)  # the same 32 bits
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return keys  # computed by the graph's replays; not cached (`launch_scratch`)
        _COLUMN_KEYS[device] = keys
    return keys


def lora_window_shrink_fwd(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta, windows: DropoutWindows,
                           group: int) -> torch.Tensor:
    """Kernel 1 with each row's dropout from its window (`DropoutWindows`, group `group`): S [T, r_max]
    float32 = dropout(x) A[slot]^T, zero rows for tokens without an adapter; rows outside every
    window without dropout. The fine-tuning engine's forward: inference rows and every job's window
    in one launch, the masks regenerated in registers (never written), S in float32 as
    `lora_ops.lora_shrink` gives it."""
    if not 0 <= group < windows.num_groups:
        raise ValueError(f"group {group} is out of range [0, {windows.num_groups})")
    return lora_train_shrink_fwd(x, lora_a, meta, None, 0, windows=(windows, group), out_dtype=torch.float32)


def lora_train_shrink_fwd(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta, slots: LoRATrainSlots | None,
                          seed: int, *, block_m: int | None = None, block_k: int | None = None,
                          num_splits: int | None = None, per_sm: int | None = None, num_warps: int | None = None,
                          num_stages: int | None = None, key_table: bool | None = None,
                          windows: tuple[DropoutWindows, int] | None = None,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Kernel 1: S [T, r_max] = dropout(x) A[slot]^T in x's dtype (or out_dtype), zero rows for tokens
    without an adapter. Dropout is each slot's p (`slots`) under `seed`, or with `windows` (a
    `DropoutWindows` and its group; slots and seed are then not read) each row's window's; with
    neither (slots None), none.

    On CUDA, in_size is split (`shrink_split_plan`) until about the configs' per_sm programs per SM
    (`per_sm`), or into `num_splits` chunks; partials are summed in a fixed order by each row
    tile's last program (bitwise reproducible). On CPU (the interpreter) the default is one split.
    The keyword arguments override tiles, splits, programs per SM, warps, stages and `key_table`
    (load the dropout hash's column keys from `column_keys` rather than mixing them per tile)."""
    check_launchable(x, _lora_train_shrink_fwd_kernel)
    num_tokens, in_size = x.shape
    max_rank = lora_a.shape[1]
    # When every token has an adapter (the usual fine-tuning batch) the kernel writes all of S:
    # no zero fill (a launch) first.
    s = (torch.empty if meta.covers_all_tokens else torch.zeros)(num_tokens, max_rank, dtype=out_dtype or x.dtype,
                                                                  device=x.device)
    if not meta.has_lora:
        return s
    cuda = x.device.type == "cuda"
    if windows is None and slots is None:
        dropout_ps, has_dropout = s, False  # not read
        win_bounds = win_table = s
        num_windows = group = 0
    elif windows is None:
        dropout_ps, has_dropout = slots.dropout_ps, slots.has_dropout
        win_bounds = win_table = s  # not read
        num_windows = group = 0
    else:
        dropout_ps, seed = s, 0  # not read
        win, group = windows
        has_dropout, win_bounds, win_table, num_windows = win.has_dropout, win.bounds, win.table, win.num_windows
    common = (meta.seg_starts, meta.seg_lens, meta.seg_slots, dropout_ps, win_bounds, win_table, in_size, max_rank,
              kernel_seed(seed), triton.next_power_of_2(num_tokens))
    tuned = train_configs(x.device)["lora_train_shrink_fwd"]
    if key_table is None:
        key_table = tuned["key_table"]
    key_table = key_table and has_dropout
    keys = column_keys(x.device, in_size) if key_table else s  # not read without
    flags = dict(HAS_DROPOUT=has_dropout, KEY_TABLE=key_table, ROW_WINDOWS=windows is not None)
    if cuda:
        block_m = block_m or tuned["block_m"]
        block_k = block_k or tuned["block_k"]
    else:
        if block_m is None:
            # The interpreter: the largest row tile (64, 32 or 16) that still gives a few programs.
            block_m = min(64, max(16, triton.next_power_of_2(meta.max_seg_len)))
            while block_m > 16 and meta.num_tokens // block_m < target_programs(x.device):
                block_m //= 2
        block_k = block_k or (32 if x.dtype == torch.float32 else 128)
        num_splits = num_splits or 1
    per_sm = per_sm or tuned["per_sm"]
    k_per_split, num_splits = shrink_split_plan(meta, in_size, max_rank, block_m, block_k, x.device, per_sm,
                                                num_splits)
    split = num_splits > 1
    if split:
        part = torch.empty(num_splits, num_tokens, max_rank, dtype=torch.float32, device=x.device)
        counters = launch_scratch("shrink", x.device, num_tokens)
    else:
        part = counters = s  # not read
    grid = (meta.num_segments, triton.cdiv(meta.max_seg_len, block_m), num_splits)
    _lora_train_shrink_fwd_kernel[grid](
        x, lora_a, s, part, counters, keys, *common, k_per_split, num_splits, num_windows, group,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), s.stride(0), part.stride(0) if split else 0,
        SPLIT=split, BLOCK_M=block_m, BLOCK_R=rank_block(max_rank), BLOCK_K=block_k, **flags,
        num_warps=num_warps or shrink_warps(block_m, max_rank, windows is not None),
        num_stages=num_stages or tuned["num_stages"],
    )
    return s

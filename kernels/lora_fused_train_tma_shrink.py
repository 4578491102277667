"""Kernels 1 and 2 of the fused LoRA training forward in one TMA launch (base_gemm="tma_shrink"):
S = dropout(x) A^T computed from the x tiles the frozen GEMM already reads (LoRAFusion, figure 9,
the split at S with the shrink inside the GEMM's pass over x).

    y = x W^T + scaling * S B^T,   S = dropout(x) A^T   (per token's adapter slot)

With S from a separate kernel 1, x is read twice and the mask hashed in a pass of its own: about
0.023 of kernel 2's 0.183 ms at 4096 x 4096 (H100, docs/benchmarks.md, session 19). Here every
output tile of a row block computes the S of one slice of in_size, the slice its column index
owns (about in / column tiles wide), in its first k steps and from the same x tiles that feed the
GEMM's dot, so the hash and the rank-wide dot run beside the GEMM's tensor-core work and x is read
once. A tile then stores that partial S (fp32), and the last of its row block's tiles to arrive
sums all of them in column order (a fixed order: bitwise reproducible), writes S (kept for the
backward) and raises the row block's flag. The other tiles run the rest of their k loop (rotated
to start after their slice) and wait for the flag only before their epilogue.

The waits cannot deadlock. Programs take tiles from a counter, one at a time (the next is taken
only once the current tile's wait is over), in grouped order with at most num_programs - 1 items
between a row block's first and last tile; a program waits only after its own partial is stored.
So when every running program waits, the lowest tile held has all its row block's tiles taken,
and taken tiles have stored their partials: its flag is up. That needs every program of the grid
resident (one per SM: the grid is the SM count, and each program fits an SM alone) and at most
num_programs column tiles (`tma_shrink_runs`). Triton's interpreter runs programs one after
another, so there a row block is one column tile (`linear_fwd_tma_shrink`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flexserve_kernels.lora_fused_train import (
    _HASH_COLUMN,
    _HASH_TOKEN,
    add_lora_fwd_term,
    column_keys,
    kernel_seed,
    keep_threshold,
    mix32,
    rank_block,
    shrink_keep,
    tile_segments,
    tile_slot,
)
from flexserve_kernels.lora_fused_train_tma import (
    _FWD_OPERANDS,
    FWD_TMA_CONFIG_SHAPES,
    _check_supported,
    _configs,
    _fits_shared_memory,
    _launch,
    _num_sms,
    _store_parts,
    tma_forward_runs,
)


@triton.jit
def _lora_train_fused_fwd_tma_kernel(
    x_desc, w_desc, y_desc, a_ptr, s_ptr, b_ptr, part_ptr, sync_ptr, keys_ptr, token_slots_ptr, token_segs_ptr,
    seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, scalings_ptr, dropout_ps_ptr, M, N, K, max_rank, seed, m_bucket,
    stride_as, stride_ar, stride_sm, stride_bs, stride_bn, stride_pp, num_programs,
    HAS_DROPOUT: tl.constexpr, KEY_TABLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr,
):
    # sync: [0] the tile counter, [1] the last launch's number, then per row block i the count of
    # its tiles whose partial is stored at [2 + 2i] and its flag at [3 + 2i] (this launch's number
    # once S is stored). The last program to take from the counter resets it and stores this
    # launch's number, and each row block's last arriver resets its count: nothing is zeroed
    # between launches. Fixed places whatever the shape: a flag left by an earlier launch of other
    # tiles is an older number, never a count or this launch's number.
    # part_ptr: fp32 [column tiles, M, BLOCK_R], partial S of column tile p at p * stride_pp.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    num_k = tl.cdiv(K, BLOCK_K)
    # GROUP_M row tiles per group at most, fewer where a row block's tiles (group_m apart in the
    # order) would span num_programs items or more.
    group_m = tl.maximum(tl.minimum((num_programs - 1) // tl.maximum(num_pid_n - 1, 1), GROUP_M), 1)
    epoch = tl.load(sync_ptr + 1, volatile=True) + 1
    arrived_ptr = sync_ptr + 2  # row block i's count at arrived_ptr + 2i, its flag one after
    ready_ptr = sync_ptr + 3
    tile = tl.atomic_add(sync_ptr, 1, sem="acq_rel")  # release: after the epoch's load
    while tile < num_tiles:
        group_size = tl.minimum(num_pid_m - tile // (group_m * num_pid_n) * group_m, group_m)
        pid_m = tile // (group_m * num_pid_n) * group_m + (tile % (group_m * num_pid_n)) % group_size
        pid_n = (tile % (group_m * num_pid_n)) // group_size
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rows = off_m + tl.arange(0, BLOCK_M)
        slot = tile_slot(token_slots_ptr, rows, M)
        k_first = pid_n * num_k // num_pid_n  # this tile's slice of S: k steps [k_first, k_last)
        k_last = (pid_n + 1) * num_k // num_pid_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if slot >= 0:  # one adapter: the slice from the GEMM's own x tiles
            acc = _gemm_shrink_steps(acc, x_desc, w_desc, off_m, off_n, k_first, k_last, rows, slot, part_ptr,
                                     pid_n, M, K, a_ptr, keys_ptr, dropout_ps_ptr, max_rank, seed, stride_as,
                                     stride_ar, stride_pp, HAS_DROPOUT, KEY_TABLE, BLOCK_K, BLOCK_R)
        else:
            acc = _gemm_steps(acc, x_desc, w_desc, off_m, off_n, k_first, k_last, num_k, BLOCK_K)
            if slot == -2:  # mixed rows: one pass over the slice per segment (x again, from L2)
                s_part = row_block_s(x_desc, off_m, M, k_first * BLOCK_K, tl.minimum(k_last * BLOCK_K, K), a_ptr,
                                     token_segs_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, dropout_ps_ptr,
                                     keys_ptr, max_rank, seed, stride_as, stride_ar, HAS_DROPOUT, KEY_TABLE,
                                     BLOCK_M, BLOCK_K, BLOCK_R)
                _store_part(part_ptr, pid_n, rows, M, s_part, stride_pp, BLOCK_R)
        if slot != -1:
            _arrive(part_ptr, s_ptr, arrived_ptr, ready_ptr, pid_m, num_pid_n, rows, M, max_rank, epoch, stride_pp,
                    stride_sm, BLOCK_M, BLOCK_R)
        acc = _gemm_steps(acc, x_desc, w_desc, off_m, off_n, k_last, num_k + k_first, num_k, BLOCK_K)
        if slot != -1:
            while tl.atomic_add(ready_ptr + 2 * pid_m, 0, sem="acquire") != epoch:
                pass
        following = tl.atomic_add(sync_ptr, 1, sem="relaxed")  # in flight during the epilogue
        cols = off_n + tl.arange(0, BLOCK_N)
        acc = add_lora_fwd_term(acc, rows, cols, M, N, s_ptr, b_ptr, token_slots_ptr, token_segs_ptr,
                                seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, scalings_ptr, max_rank, stride_sm,
                                stride_bs, stride_bn, BLOCK_R)
        _store_parts(acc, y_desc, off_m, off_n, EPILOGUE_SPLIT)
        tile = following
    if tile == num_tiles + num_programs - 1:  # every program has taken its last item
        tl.store(sync_ptr + 1, epoch)
        tl.store(sync_ptr, 0)


@triton.jit
def _gemm_steps(acc, x_desc, w_desc, off_m, off_n, step_begin, step_end, num_k, BLOCK_K: tl.constexpr):
    """acc + x W^T over k steps [step_begin, step_end), step s at column (s mod num_k) * BLOCK_K."""
    for step in range(step_begin, step_end):
        k = tl.where(step >= num_k, step - num_k, step) * BLOCK_K
        acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc, input_precision="ieee")
    return acc


@triton.jit
def _gemm_shrink_steps(acc, x_desc, w_desc, off_m, off_n, step_begin, step_end, rows, slot, part_ptr, part, M, K,
                       a_ptr, keys_ptr, dropout_ps_ptr, max_rank, seed, stride_as, stride_ar, stride_pp,
                       HAS_DROPOUT: tl.constexpr, KEY_TABLE: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    """acc + x W^T over k steps [step_begin, step_end), and the partial S of those columns of rows
    whose adapter is `slot`, dropout(x) A[slot]^T scaled by 1 / (1 - p), stored as part `part`."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < max_rank
    # lora_a[slot] is [max_rank, in]; read as its transpose [BLOCK_K, BLOCK_R] for the dot.
    a_ptrs = (a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
              + (step_begin * BLOCK_K + offs_k)[:, None])
    if HAS_DROPOUT:
        p = tl.load(dropout_ps_ptr + slot)
        threshold_hi = keep_threshold(p) << 8
        row_keys = mix32((rows.to(tl.uint32) * _HASH_TOKEN + seed).to(tl.uint32))  # as `dropout_keep`
    s_acc = tl.zeros((rows.shape[0], BLOCK_R), dtype=tl.float32)
    for step in range(step_begin, step_end):
        k = step * BLOCK_K
        x_tile = x_desc.load([off_m, k])
        acc = tl.dot(x_tile, w_desc.load([off_n, k]).T, acc, input_precision="ieee")
        k_mask = offs_k < K - k
        if HAS_DROPOUT:
            x_tile = tl.where(shrink_keep(row_keys, _column_keys(keys_ptr, k + offs_k, k_mask, KEY_TABLE),
                                          threshold_hi), x_tile, 0.0)
        a_tile = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        s_acc = tl.dot(x_tile, a_tile, s_acc, input_precision="ieee")
        a_ptrs += BLOCK_K
    if HAS_DROPOUT:
        s_acc = s_acc * (1.0 / (1.0 - p))
    _store_part(part_ptr, part, rows, M, s_acc, stride_pp, BLOCK_R)
    return acc


@triton.jit
def _column_keys(keys_ptr, cols, mask, KEY_TABLE: tl.constexpr):
    """The dropout hash's mixed keys of columns `cols` (`dropout_keep`'s col_keys)."""
    if KEY_TABLE:  # mixed once per device (`column_keys`)
        return tl.load(keys_ptr + cols, mask=mask, other=0).to(tl.uint32, bitcast=True)
    return mix32(cols.to(tl.uint32) * _HASH_COLUMN)


@triton.jit
def row_block_s(x_desc, off_m, M, k_begin, k_end, a_ptr, token_segs_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
                dropout_ps_ptr, keys_ptr, max_rank, seed, stride_as, stride_ar, HAS_DROPOUT: tl.constexpr,
                KEY_TABLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """Kernel 1's S over the columns [k_begin, k_end) for the rows [off_m, off_m + BLOCK_M) of
    several adapters, in fp32 [BLOCK_M, BLOCK_R], x read through a descriptor of [BLOCK_M,
    BLOCK_K] blocks (rows past M read as zeros): one pass per segment the rows overlap, each
    keeping its own rows, so rows without an adapter stay zero."""
    rows = off_m + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < max_rank
    row_keys = mix32((rows.to(tl.uint32) * _HASH_TOKEN + seed).to(tl.uint32))  # as `dropout_keep`
    s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    seg_first, seg_end = tile_segments(token_segs_ptr, rows, M)
    for seg in range(seg_first, seg_end):
        start = tl.load(seg_starts_ptr + seg)
        in_seg = (rows >= start) & (rows < start + tl.load(seg_lens_ptr + seg))
        slot = tl.load(seg_slots_ptr + seg)
        a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar + (k_begin + offs_k)[:, None]
        if HAS_DROPOUT:
            p = tl.load(dropout_ps_ptr + slot)
            threshold_hi = keep_threshold(p) << 8
        seg_s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(k_begin, k_end, BLOCK_K):
            k_mask = offs_k < k_end - k
            x_tile = x_desc.load([off_m, k])
            if HAS_DROPOUT:
                x_tile = tl.where(shrink_keep(row_keys, _column_keys(keys_ptr, k + offs_k, k_mask, KEY_TABLE),
                                              threshold_hi), x_tile, 0.0)
            a_tile = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            seg_s = tl.dot(x_tile, a_tile, seg_s, input_precision="ieee")
            a_ptrs += BLOCK_K
        if HAS_DROPOUT:
            seg_s = seg_s * (1.0 / (1.0 - p))
        s = tl.where(in_seg[:, None], seg_s, s)
    return s


@triton.jit
def _store_part(part_ptr, part, rows, M, s_part, stride_pp, BLOCK_R: tl.constexpr):
    offs_r = tl.arange(0, BLOCK_R)
    tl.store(part_ptr + part * stride_pp + rows.to(tl.int64)[:, None] * BLOCK_R + offs_r[None, :], s_part,
             mask=(rows < M)[:, None])


@triton.jit
def _arrive(part_ptr, s_ptr, arrived_ptr, ready_ptr, pid_m, num_parts, rows, M, max_rank, epoch, stride_pp,
            stride_sm, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """Count this tile's stored partial into its row block; the last of the row block's tiles sums
    the num_parts partials in order, stores S and raises the row block's flag."""
    tl.debug_barrier()  # every thread's partial stores before the count's release (one thread's atomic)
    if tl.atomic_add(arrived_ptr + 2 * pid_m, 1, sem="acq_rel") == num_parts - 1:
        tl.store(arrived_ptr + 2 * pid_m, 0)  # every tile of the row block has counted: ready for the next launch
        offs_r = tl.arange(0, BLOCK_R)
        row_mask = (rows < M)[:, None]
        part_ptrs = part_ptr + rows.to(tl.int64)[:, None] * BLOCK_R + offs_r[None, :]
        s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for part in range(0, num_parts):
            s += tl.load(part_ptrs + part * stride_pp, mask=row_mask, other=0.0, cache_modifier=".cg")
        tl.store(s_ptr + rows.to(tl.int64)[:, None] * stride_sm + offs_r[None, :], s.to(s_ptr.dtype.element_ty),
                 mask=row_mask & (offs_r < max_rank)[None, :])
        tl.debug_barrier()  # every thread's S stores before the flag's release
        tl.atomic_xchg(ready_ptr + 2 * pid_m, epoch, sem="release")


# Candidates: kernel 2's 8-warp ones without warp specialization, which needs `tl.range`'s static
# loop over tiles, not this kernel's counter; at 4 warps the hash spilled 120 bytes at rank 32
# (ptxas, sm_90, triton 3.9). The slice's loop shares the main loop's shared memory.
FUSED_TMA_CONFIG_SHAPES = tuple((*shape[:5], shape[6]) for shape in FWD_TMA_CONFIG_SHAPES
                                if shape[3] == 8 and not shape[5])
_MIN_BLOCK_N = min(shape[1] for shape in FUSED_TMA_CONFIG_SHAPES)
_FUSED_EXTRAS = ("EPILOGUE_SPLIT",)


def fused_config_fits(block_n: int, block_r: int) -> bool:
    """Whether a candidate's tiles take this rank block without spilling: 128 x 256 tiles spilled
    24 bytes at rank 32 with dropout (ptxas, sm_90, triton 3.9), so above 16 only 128-wide ones."""
    return block_r <= 16 or block_n <= 128


def _prune(configs, named_args, **kwargs):
    """`_fits_shared_memory` over the candidates that `fused_config_fits` this launch's rank."""
    block_r = rank_block(named_args["max_rank"])
    return _fits_shared_memory([c for c in configs if fused_config_fits(c.kwargs["BLOCK_N"], block_r)], named_args,
                               **kwargs)


_fused_tuned = triton.autotune(configs=_configs(FUSED_TMA_CONFIG_SHAPES, _FWD_OPERANDS, _FUSED_EXTRAS),
                               key=["m_bucket", "N", "K", "max_rank", "HAS_DROPOUT"],
                               prune_configs_by={"early_config_prune": _prune})(
    _lora_train_fused_fwd_tma_kernel)
_SYNC: dict[tuple[torch.device, int], torch.Tensor] = {}


def tma_shrink_runs(x: torch.Tensor, weight: torch.Tensor, max_rank: int) -> bool:
    """Whether base_gemm="tma_shrink" runs on a CUDA GPU here: kernel 2 over TMA runs
    (`tma_forward_runs`) and a row block has at most one column tile per SM (the waits' rule)."""
    return (tma_forward_runs(x, weight, max_rank)
            and triton.cdiv(weight.shape[0], _MIN_BLOCK_N) <= _num_sms(x.device))


def fused_sync(device: torch.device, num_tokens: int) -> torch.Tensor:
    """The launch's int32 sync state [2 + >= num_tokens] (`_lora_train_fused_fwd_tma_kernel`: two
    words per row block of >= 2 tokens). Zeroed once, then left ready by each launch for the next;
    cached per device and stream (launches on one stream never overlap)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    sync = _SYNC.get((device, stream))
    if sync is None or sync.numel() < 2 + num_tokens:
        sync = torch.zeros(2 + max(1024, triton.next_power_of_2(num_tokens)), dtype=torch.int32, device=device)
        _SYNC[(device, stream)] = sync
    return sync


def linear_fwd_tma_shrink(x, weight, lora_a, s, lora_b, y, token_segs, meta, slots, seed, blocks=None,
                          epilogue_split=1) -> None:
    """Kernels 1 and 2 in one launch: S into s [T, r_max] (rows of row blocks without an adapter
    left as they are: zero them first unless every token has one) and y [T, out]. Autotuned on
    CUDA unless `blocks` = (BLOCK_M, BLOCK_N, BLOCK_K) is given (with the store in
    `epilogue_split` column parts); Triton's interpreter takes one column tile per row block
    (BLOCK_N widened to out), since it runs programs one at a time and a tile waits for the others
    of its row block."""
    _check_supported(lora_a.shape[1], x, weight, y)
    num_tokens, in_size = x.shape
    out_size, max_rank = lora_b.shape[1], lora_b.shape[2]
    if x.is_cuda and not tma_shrink_runs(x, weight, max_rank):
        raise ValueError(f"base_gemm='tma_shrink' takes up to {_num_sms(x.device) * _MIN_BLOCK_N} output features "
                         f"on this GPU, got {out_size} (use base_gemm='tma')")
    if not x.is_cuda:
        bm, bn, bk = blocks or (16, 32, 32)
        blocks = (bm, max(bn, triton.next_power_of_2(out_size)), bk)
    min_block_n = blocks[1] if blocks else _MIN_BLOCK_N
    parts = torch.empty(triton.cdiv(out_size, min_block_n), num_tokens, rank_block(max_rank), dtype=torch.float32,
                        device=x.device)
    keys = column_keys(x.device, in_size) if slots.has_dropout else s  # not read without dropout
    rest = (lora_a, s, lora_b, parts, fused_sync(x.device, num_tokens), keys, meta.token_slots, token_segs,
            meta.seg_starts, meta.seg_lens, meta.seg_slots, slots.scalings, slots.dropout_ps, num_tokens, out_size,
            in_size, max_rank, kernel_seed(seed), triton.next_power_of_2(num_tokens), lora_a.stride(0),
            lora_a.stride(1), s.stride(0), lora_b.stride(0), lora_b.stride(1), parts.stride(0))
    _launch(_lora_train_fused_fwd_tma_kernel, _fused_tuned, _FWD_OPERANDS, (x, weight, y), rest, num_tokens,
            out_size, max_rank, blocks, untuned=dict(EPILOGUE_SPLIT=epilogue_split), full_grid=True,
            HAS_DROPOUT=slots.has_dropout, KEY_TABLE=slots.has_dropout)

"""Fused LoRA training backward (LoRAFusion figure 10b), for one or many adapters, without atomics.

Only x and S = dropout(x) A^T are kept from the forward; the dropout mask is regenerated.
  kernel 3 (`lora_train_ds_db_bwd`): dS = scaling dY B and dB = scaling dY^T S in one pass over dY;
  kernel 4 (`lora_train_dx_term`): dX's LoRA term dropout'(dS A) (dropout' = the same mask /
  (1 - p)), which torch's GEMM takes as its C operand when it adds dY W (cuBLAS's epilogue);
  kernel 5 (`lora_train_da_bwd`): dA = dS^T dropout(x), a small GEMM over the adapter rows;
  kernels 4's term and 5 in one pass (`lora_train_dx_term_da_bwd`, what `fused_lora_linear` and
  the fine-tuning engine run): both walk the [T, in] tiles of the adapter rows with the same keep
  mask, so one walk reads x, hashes each tile's mask once, adds to dA and stores the term.
dB and dA sum over tokens of a slot. Each program owns a chunk of rows of one segment and writes its
partial sum; a second kernel adds a slot's partials in a fixed order (as `sum_parts` adds kernel 3's
dS partials over its column splits). Nothing uses atomics, so gradients are bitwise reproducible run
to run (deterministic training with no separate mode).
The partials take num_segments x (up to 8 chunks) x (in + out) x r_max x 4 bytes: keep each
adapter's tokens contiguous (LoRAKernelMeta merges consecutive rows of one slot into a segment);
a batch that interleaves adapters row by row has one segment per row and that many partials.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
from flexserve_kernels.lora.serve.shrink import check_launchable, target_programs
from flexserve_kernels.lora.train.configs import CONFIGS_DIR, train_configs
from flexserve_kernels.lora.train.fused import (
    LoRATrainSlots,
    dropout_keep,
    grouped_tile,
    keep_threshold,
    kernel_seed,
    rank_block,
    term_tiles,
    term_tuner,
    tile_segments,
    token_segments,
)
from flexserve_kernels.tuned_configs import by_rank, device_name, load_configs


@triton.jit
def _chunk_rows(seg_starts_ptr, seg_slots_ptr, seg, seg_len, chunk, rows_per_chunk):
    """(slot, first row, row past the end) of one segment's row chunk in the flat batch."""
    start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    return (slot, start + chunk * rows_per_chunk,
            start + tl.minimum(seg_len, (chunk + 1) * rows_per_chunk))


@triton.jit
def _lora_train_ds_db_bwd_kernel(
    dy_ptr, b_ptr, s_ptr, ds_part_ptr, db_part_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, scalings_ptr,
    N, max_rank, rows_per_chunk, n_per_split, num_chunks,
    stride_dym, stride_bs, stride_bn, stride_sm, stride_dss, stride_dsm, stride_dbi, stride_dbn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # Grid: (segment, row chunk, column split). Columns outer, rows inner: the dB tile stays in
    # registers over the chunk's rows; the chunk's dS partial (rows x r fp32, L2-sized) is
    # re-read and added once per column tile.
    seg = tl.program_id(0)
    chunk = tl.program_id(1)
    split = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if chunk * rows_per_chunk >= seg_len:
        return
    slot, row_begin, row_stop = _chunk_rows(seg_starts_ptr, seg_slots_ptr, seg, seg_len, chunk, rows_per_chunk)
    scale = tl.load(scalings_ptr + slot)
    n_begin = split * n_per_split
    n_stop = tl.minimum(N, n_begin + n_per_split)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < max_rank
    item = (seg * num_chunks + chunk).to(tl.int64)
    for n0 in range(n_begin, n_stop, BLOCK_N):
        cols = n0 + offs_n
        n_mask = cols < n_stop
        b_tile = tl.load(b_ptr + slot * stride_bs + cols.to(tl.int64)[:, None] * stride_bn + offs_r[None, :],
                         mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        db_acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        for m0 in range(row_begin, row_stop, BLOCK_M):
            rows = m0 + offs_m
            m_mask = rows < row_stop
            dy_tile = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * stride_dym + cols[None, :],
                              mask=m_mask[:, None] & n_mask[None, :], other=0.0)
            s_tile = tl.load(s_ptr + rows.to(tl.int64)[:, None] * stride_sm + offs_r[None, :],
                             mask=m_mask[:, None] & r_mask[None, :], other=0.0)
            db_acc = tl.dot(tl.trans(dy_tile), s_tile.to(dy_tile.dtype), db_acc, input_precision="ieee")
            ds_ptrs = ds_part_ptr + split * stride_dss + rows.to(tl.int64)[:, None] * stride_dsm + offs_r[None, :]
            ds_mask = m_mask[:, None] & r_mask[None, :]
            ds = tl.dot(dy_tile, b_tile, input_precision="ieee") * scale
            if n0 > n_begin:  # the split's first column tile stores; the others add to it
                ds += tl.load(ds_ptrs, mask=ds_mask, other=0.0)
            tl.store(ds_ptrs, ds, mask=ds_mask)
        db_ptrs = db_part_ptr + item * stride_dbi + cols.to(tl.int64)[:, None] * stride_dbn + offs_r[None, :]
        tl.store(db_ptrs, db_acc * scale, mask=n_mask[:, None] & r_mask[None, :])


# Arguments that change from call to call (dropout seeds, window lengths, chunk counts) are not
# specialized in the kernels the fine-tuning engine calls (5, 4's term, the reduction): Triton
# would compile a variant per value class (1, a multiple of 16, other), a compile in the middle of
# a window when a new class turns up. Chunk and split sizes stay specialized: they are multiples of the
# tiles (one class), and their divisibility is what lets the loads vectorize.
@triton.jit(do_not_specialize=["seed", "num_chunks"])
def _lora_train_da_bwd_kernel(
    x_ptr, ds_ptr, a_ptr, term_ptr, da_part_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, dropout_ps_ptr,
    K, max_rank, seed, rows_per_chunk, k_per_split, num_chunks,
    stride_xm, stride_dsm, stride_as, stride_ar, stride_tm, stride_dai, stride_dar,
    WITH_TERM: tl.constexpr, HAS_DROPOUT: tl.constexpr, MASK_X: tl.constexpr, SPLIT_DS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # Kernel 5 over the [T, in] tiles of the adapter rows; grid: (segment, row chunk, column
    # split) as in kernel 3; dropout(x) is rebuilt per tile. WITH_TERM: kernel 4's term in the
    # same pass: the tile's keep mask also masks dS A (dropout'(dS A)), which is stored, so the
    # walk, x's read and the hash are shared. SPLIT_DS: dS (fp32) enters the MMAs as two 16-bit
    # halves (`split_ds`), not rounded to one. MASK_X = False: x is already dropped (a stored
    # dropout output), so dA takes it as it is; the term is masked still.
    seg = tl.program_id(0)
    chunk = tl.program_id(1)
    split = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if chunk * rows_per_chunk >= seg_len:
        return
    slot, row_begin, row_stop = _chunk_rows(seg_starts_ptr, seg_slots_ptr, seg, seg_len, chunk, rows_per_chunk)
    p = tl.load(dropout_ps_ptr + slot)
    threshold = keep_threshold(p)
    inv_keep = 1.0 / (1.0 - p)
    k_begin = split * k_per_split
    k_stop = tl.minimum(K, k_begin + k_per_split)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < max_rank
    item = (seg * num_chunks + chunk).to(tl.int64)
    for k0 in range(k_begin, k_stop, BLOCK_K):
        cols = k0 + offs_k
        k_mask = cols < k_stop
        if WITH_TERM:
            a_tile = tl.load(a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + cols[None, :],
                             mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        da_acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for m0 in range(row_begin, row_stop, BLOCK_M):
            rows = m0 + offs_m
            m_mask = rows < row_stop
            x_tile = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :],
                             mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            ds_tile = tl.load(ds_ptr + rows.to(tl.int64)[:, None] * stride_dsm + offs_r[None, :],
                              mask=m_mask[:, None] & r_mask[None, :], other=0.0)
            if HAS_DROPOUT:
                keep = dropout_keep(seed, rows, cols, threshold)
                if MASK_X:
                    x_tile = tl.where(keep, x_tile, 0.0)
            if SPLIT_DS:
                ds_hi, ds_lo = split_ds(ds_tile, x_tile.dtype)
                da_acc = tl.dot(tl.trans(ds_hi), x_tile, da_acc, input_precision="ieee")
                da_acc = tl.dot(tl.trans(ds_lo), x_tile, da_acc, input_precision="ieee")
            else:
                da_acc = tl.dot(tl.trans(ds_tile.to(x_tile.dtype)), x_tile, da_acc, input_precision="ieee")
            if WITH_TERM:
                # the term's dS carries dropout's scale, as in kernel 4 (the same bits)
                term = ds_times_a(ds_tile * inv_keep if HAS_DROPOUT else ds_tile, a_tile, SPLIT_DS)
                if HAS_DROPOUT:
                    term = tl.where(keep, term, 0.0)
                tl.store(term_ptr + rows.to(tl.int64)[:, None] * stride_tm + cols[None, :],
                         term.to(term_ptr.dtype.element_ty), mask=m_mask[:, None] & k_mask[None, :])
        if HAS_DROPOUT and MASK_X:
            da_acc = da_acc * inv_keep  # dropout's scale, once per dA element
        da_ptrs = da_part_ptr + item * stride_dai + offs_r[:, None] * stride_dar + cols[None, :]
        tl.store(da_ptrs, da_acc, mask=r_mask[:, None] & k_mask[None, :])


@triton.jit
def add_in_order(acc, ptr, stride, count, offs, mask, UNROLL: tl.constexpr):
    """acc + ptr[i * stride + offs] for i = 0 .. count - 1, added in that order (reproducible),
    UNROLL loads in flight at a time: a rolled loop would wait out L2's latency per term."""
    for i0 in range(0, count, UNROLL):
        for j in tl.static_range(UNROLL):
            # an elementwise mask (Triton 3.9's interpreter rejects one and-ed with a scalar)
            valid = mask & (tl.zeros_like(offs) + (i0 + j) < count)
            acc += tl.load(ptr + (tl.full((), i0 + j, tl.int64) * stride) + offs, mask=valid, other=0.0)
    return acc


@triton.jit(do_not_specialize=["num_segments", "num_chunks"])
def _lora_train_slot_reduce_kernel(
    part_ptr, out_ptr, seg_lens_ptr, seg_slots_ptr,
    num_segments, num_chunks, rows_per_chunk, numel, stride_item, stride_slot,
    ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
):
    # Grid: (slot, block of the flattened gradient). Sums the slot's chunk partials in segment
    # order (fixed: reproducible); slots without tokens get zeros. ACCUMULATE: the sum is added
    # to what out holds (after it, in the same order every time).
    slot = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for seg in range(0, num_segments):
        if tl.load(seg_slots_ptr + seg) == slot:
            num_valid = tl.minimum(tl.cdiv(tl.load(seg_lens_ptr + seg), rows_per_chunk), num_chunks)
            acc = add_in_order(acc, part_ptr + (seg * num_chunks).to(tl.int64) * stride_item, stride_item,
                               num_valid, offs, mask, UNROLL)
    out_ptrs = out_ptr + slot.to(tl.int64) * stride_slot + offs
    if ACCUMULATE:
        acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_parts"])
def _sum_parts_kernel(part_ptr, out_ptr, numel, num_parts, stride_part, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    # out[:numel] = part[0] + part[1] + ... in that order (kernel 3's dS over its column splits).
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = add_in_order(tl.zeros((BLOCK,), dtype=tl.float32), part_ptr, stride_part, num_parts, offs, mask, UNROLL)
    tl.store(out_ptr + offs, acc, mask=mask)


@triton.jit
def split_ds(ds, dtype: tl.constexpr):
    """fp32 ds as (hi, lo) in a 16-bit `dtype` with hi + lo within 2^-17 |ds| of ds: products
    with a 16-bit operand keep about 16 significant bits of ds (the engine's `split_bf16`)."""
    hi = ds.to(dtype)
    return hi, (ds - hi.to(tl.float32)).to(dtype)


@triton.jit
def ds_times_a(ds, a_tile, SPLIT_DS: tl.constexpr):
    """dS [rows, r] (fp32) times A's tile [r, cols] in fp32: dS rounded to A's dtype, or as two
    halves of it (`split_ds`)."""
    if SPLIT_DS:
        ds_hi, ds_lo = split_ds(ds, a_tile.dtype)
        return tl.dot(ds_lo, a_tile, tl.dot(ds_hi, a_tile, input_precision="ieee"), input_precision="ieee")
    return tl.dot(ds.to(a_tile.dtype), a_tile, input_precision="ieee")


@triton.jit
def add_lora_dx_term(acc, rows, cols, M, N, ds_ptr, a_ptr, token_segs_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
                     dropout_ps_ptr, max_rank, seed, stride_dsm, stride_as, stride_ar, HAS_DROPOUT: tl.constexpr,
                     SPLIT_DS: tl.constexpr, BLOCK_R: tl.constexpr):
    """acc [rows, cols of in] + dropout'(dS A[slot]) for each adapter segment the row tile overlaps
    (kernel 4's epilogue, the same in every form of it); SPLIT_DS as in kernel 5."""
    seg_first, seg_end = tile_segments(token_segs_ptr, rows, M)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < max_rank
    if seg_end > seg_first:
        ds_tile = tl.load(ds_ptr + rows.to(tl.int64)[:, None] * stride_dsm + offs_r[None, :],
                          mask=(rows < M)[:, None] & r_mask[None, :], other=0.0)
        for seg in range(seg_first, seg_end):
            start = tl.load(seg_starts_ptr + seg)
            in_seg = (rows >= start) & (rows < start + tl.load(seg_lens_ptr + seg))
            slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
            a_tile = tl.load(a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + cols[None, :],
                             mask=r_mask[:, None] & (cols < N)[None, :], other=0.0)
            ds_seg = tl.where(in_seg[:, None], ds_tile, 0.0)
            if HAS_DROPOUT:
                p = tl.load(dropout_ps_ptr + slot)
                # dropout's scale on dS ([BLOCK_M, r]) rather than on every element of the tile
                ds_seg = ds_seg * (1.0 / (1.0 - p))
            lora = ds_times_a(ds_seg, a_tile, SPLIT_DS)
            if HAS_DROPOUT:
                lora = tl.where(dropout_keep(seed, rows, cols, keep_threshold(p)), lora, 0.0)
            acc += lora
    return acc


@triton.jit(do_not_specialize=["M", "seed", "m_bucket"])
def _lora_train_dx_bwd_kernel(
    ds_ptr, a_ptr, dx_ptr, token_segs_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
    dropout_ps_ptr, M, N, max_rank, seed, m_bucket, stride_dsm, stride_as, stride_ar, stride_dxm,
    HAS_DROPOUT: tl.constexpr, SPLIT_DS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Kernel 4's LoRA term, dropout'(dS A) [M, N=in]: the caller adds dY W in cuBLAS. m_bucket is
    # only the autotuner's key; BLOCK_K is unused (the configs' shared form).
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rows < M
    n_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = add_lora_dx_term(acc, rows, cols, M, N, ds_ptr, a_ptr, token_segs_ptr, seg_starts_ptr, seg_lens_ptr,
                           seg_slots_ptr, dropout_ps_ptr, max_rank, seed, stride_dsm, stride_as, stride_ar,
                           HAS_DROPOUT, SPLIT_DS, BLOCK_R)
    tl.store(dx_ptr + rows.to(tl.int64)[:, None] * stride_dxm + cols[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@functools.cache
def _dx_term_tuner(name: str | None):
    return term_tuner(_lora_train_dx_bwd_kernel, load_configs(CONFIGS_DIR, name)["lora_train_dx_bwd_term"])


def dx_term_tuned(device: torch.device):
    """Kernel 4's LoRA term (base_gemm="blas", the dropout hash beside the accumulator) autotuned
    over the candidates of device's configs file (one autotuner per GPU name)."""
    return _dx_term_tuner(device_name(device))


def chunk_plan(meta: LoRAKernelMeta, num_cols: int, block_m: int, block_cols: int, device: torch.device,
               per_sm: int = 2, max_chunks: int = 8):
    """(rows_per_chunk, num_chunks, cols_per_split, num_splits) for kernels 3 and 5: up to
    `max_chunks` row chunks per segment (each chunk's partial gradient costs a [cols, r] fp32
    write), then column splits until about `per_sm` programs per SM."""
    num_chunks = min(max_chunks, triton.cdiv(meta.max_seg_len, block_m))
    rows_per_chunk = triton.cdiv(triton.cdiv(meta.max_seg_len, num_chunks), block_m) * block_m
    num_chunks = triton.cdiv(meta.max_seg_len, rows_per_chunk)
    max_splits = triton.cdiv(num_cols, block_cols)
    num_splits = max(1, min(max_splits, target_programs(device, per_sm) // (meta.num_segments * num_chunks)))
    cols_per_split = triton.cdiv(max_splits, num_splits) * block_cols
    return rows_per_chunk, num_chunks, cols_per_split, triton.cdiv(num_cols, cols_per_split)


# The partial-sum kernels: elements per program and partials in flight per element. 256 x 8 keeps a
# [16, 4096] fp32 gradient's sum on 256 programs with eight loads in flight each.
SUM_BLOCK, SUM_UNROLL = 256, 8


def _reduce_by_slot(part: torch.Tensor, out: torch.Tensor, meta: LoRAKernelMeta, rows_per_chunk: int,
                    num_chunks: int, accumulate: bool = False) -> None:
    numel = part[0].numel()
    _lora_train_slot_reduce_kernel[(out.shape[0], triton.cdiv(numel, SUM_BLOCK))](
        part, out, meta.seg_lens, meta.seg_slots, meta.num_segments, num_chunks, rows_per_chunk, numel,
        part.stride(0), out.stride(0), ACCUMULATE=accumulate, BLOCK=SUM_BLOCK, UNROLL=SUM_UNROLL, num_warps=2,
    )


def sum_parts(part: torch.Tensor) -> torch.Tensor:
    """part [n, ...] (contiguous fp32) summed over its first dimension in index order."""
    out = torch.empty(part.shape[1:], dtype=part.dtype, device=part.device)
    numel = out.numel()
    _sum_parts_kernel[(triton.cdiv(numel, SUM_BLOCK),)](part, out, numel, part.shape[0], part.stride(0),
                                                        BLOCK=SUM_BLOCK, UNROLL=SUM_UNROLL, num_warps=2)
    return out


def lora_train_ds_db_bwd(dy: torch.Tensor, lora_b: torch.Tensor, s: torch.Tensor, meta: LoRAKernelMeta,
                         slots: LoRATrainSlots, *, block_m: int | None = None, block_n: int | None = None,
                         num_warps: int | None = None, num_stages: int = 3, per_sm: int | None = None,
                         db_out: torch.Tensor | None = None):
    """Kernel 3: (dS [T, r_max] float32, zero rows without an adapter; dB like lora_b). The
    keyword arguments override the tiles, warps, stages and programs per SM (tuning).
    `db_out`: an fp32 [slots, out, r_max] buffer that dB is added to (and returned)."""
    check_launchable(dy, _lora_train_ds_db_bwd_kernel)
    num_tokens, out_size = dy.shape
    max_rank = lora_b.shape[2]
    if db_out is not None and (db_out.shape != lora_b.shape or db_out.dtype != torch.float32
                               or not db_out.is_contiguous()):
        raise ValueError(f"db_out must be a contiguous float32 tensor of lora_b's shape {tuple(lora_b.shape)}")
    if not meta.has_lora:
        return (torch.zeros(num_tokens, max_rank, dtype=torch.float32, device=dy.device),
                torch.zeros_like(lora_b) if db_out is None else db_out)
    # 16-bit operands at rank 16 take the configs' widest tile (one program per SM: its 3 stages of
    # dY tiles fill the shared memory); fp32 operands, or a caller's own tile, take the fp32 table,
    # whose tiles fit shared memory at 4 bytes an element.
    wide = (dy.device.type == "cuda" and dy.dtype != torch.float32 and max_rank <= 16 and block_m is None
            and block_n is None)
    op = "lora_train_ds_db_bwd" if wide else "lora_train_ds_db_bwd_fp32"
    tuned = by_rank(train_configs(dy.device)[op]["by_rank"], max_rank)
    block_m = block_m or (16 if dy.device.type != "cuda" else tuned["block_m"])
    block_n = block_n or (32 if dy.device.type != "cuda" else tuned["block_n"])
    num_warps = num_warps or tuned["num_warps"]
    per_sm = per_sm or tuned["per_sm"]
    rows_per_chunk, num_chunks, n_per_split, num_splits = chunk_plan(meta, out_size, block_m, block_n, dy.device,
                                                                     per_sm)
    # every adapter row is stored by every split; only rows without an adapter need zeros
    alloc = torch.empty if meta.covers_all_tokens else torch.zeros
    ds_part = alloc(num_splits, num_tokens, max_rank, dtype=torch.float32, device=dy.device)
    db_part = torch.empty(meta.num_segments * num_chunks, out_size, max_rank, dtype=torch.float32, device=dy.device)
    _lora_train_ds_db_bwd_kernel[(meta.num_segments, num_chunks, num_splits)](
        dy, lora_b, s, ds_part, db_part, meta.seg_starts, meta.seg_lens, meta.seg_slots, slots.scalings,
        out_size, max_rank, rows_per_chunk, n_per_split, num_chunks,
        dy.stride(0), lora_b.stride(0), lora_b.stride(1), s.stride(0), ds_part.stride(0), ds_part.stride(1),
        db_part.stride(0), db_part.stride(1),
        # ptxas (sm_90, triton 3.9, bf16): 64 x 128 x rank 16 takes 130 registers at 4 warps; rank 128
        # spills there, hence 64-wide column tiles and 8 warps above rank 32.
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=rank_block(max_rank),
        num_warps=num_warps, num_stages=num_stages,
    )
    db = torch.empty_like(lora_b) if db_out is None else db_out
    _reduce_by_slot(db_part, db, meta, rows_per_chunk, num_chunks, accumulate=db_out is not None)
    return (ds_part[0] if num_splits == 1 else sum_parts(ds_part)), db


def lora_train_da_bwd(x: torch.Tensor, ds: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta,
                      slots: LoRATrainSlots, seed: int, *, block_m: int | None = None,
                      block_k: int | None = None, num_warps: int | None = None, num_stages: int = 3,
                      per_sm: int | None = None, split_ds: bool = False,
                      da_out: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel 5: dA [slots, r_max, in] (lora_a's dtype) = dS^T dropout(x) per slot, zero for unused
    slots. The keyword arguments override the tiles, warps, stages and programs per SM (tuning).
    `split_ds`: dS enters the products as two 16-bit halves (about 16 significant bits, not 8).
    `da_out`: an fp32 [slots, r_max, in] buffer that dA is added to (and returned)."""
    check_launchable(x, _lora_train_da_bwd_kernel)
    in_size = x.shape[1]
    max_rank = lora_a.shape[1]
    if not meta.has_lora:
        return torch.zeros_like(lora_a)
    # Small row tiles at several programs per SM: dA's products are short (r rows), so resident
    # programs are what hide the loads.
    tuned = by_rank(train_configs(x.device)["lora_train_da_bwd"]["by_rank"], max_rank)
    block_m = block_m or (16 if x.device.type != "cuda" else tuned["block_m"])
    block_k = block_k or (32 if x.device.type != "cuda" else tuned["block_k"])
    num_warps = num_warps or tuned["num_warps"]
    per_sm = per_sm or tuned["per_sm"]
    rows_per_chunk, num_chunks, k_per_split, num_splits = chunk_plan(meta, in_size, block_m, block_k, x.device,
                                                                     per_sm)
    da_part = torch.empty(meta.num_segments * num_chunks, max_rank, in_size, dtype=torch.float32, device=x.device)
    # Without the term, A and the term are not read: x stands in for their pointers.
    _lora_train_da_bwd_kernel[(meta.num_segments, num_chunks, num_splits)](
        x, ds, x, x, da_part, meta.seg_starts, meta.seg_lens, meta.seg_slots, slots.dropout_ps,
        in_size, max_rank, kernel_seed(seed), rows_per_chunk, k_per_split, num_chunks,
        x.stride(0), ds.stride(0), 0, 0, 0, da_part.stride(0), da_part.stride(1),
        # ptxas (sm_90, triton 3.9, bf16, dropout on): 64 x 128 x tiles spill at 4 warps (rank 16);
        # at rank 128, 64 x 64 spills at 8 warps, 32 x 64 takes 215 registers.
        WITH_TERM=False, HAS_DROPOUT=slots.has_dropout, MASK_X=True, SPLIT_DS=split_ds and x.dtype != torch.float32,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=rank_block(max_rank), num_warps=num_warps, num_stages=num_stages,
    )
    da = torch.empty_like(lora_a) if da_out is None else da_out
    _reduce_by_slot(da_part, da, meta, rows_per_chunk, num_chunks, accumulate=da_out is not None)
    return da


# Above this rank the one pass spills on every tile tried from 16 x 32 to 64 x 64 at 4 and 8 warps
# (dS split in two; ptxas, sm_90, triton 3.9), so the two kernels run instead.
MAX_TERM_DA_RANK = 64


def term_da_tiles(max_rank: int, configs: dict | None = None) -> tuple[int, int, int]:
    """`lora_train_dx_term_da_bwd`'s (BLOCK_M, BLOCK_K, num_warps) on CUDA by rank, from `configs`
    (the current GPU's by default). Ranks above 16 keep sizes that compile without spills (ptxas,
    sm_90, triton 3.9)."""
    tiles = by_rank((configs or train_configs())["lora_train_dx_term_da_bwd"]["by_rank"], max_rank)
    return tiles["block_m"], tiles["block_k"], tiles["num_warps"]


def term_da_chunks(meta: LoRAKernelMeta, in_size: int, block_k: int, device: torch.device, per_sm: int,
                   lean: bool, tuned: dict | None = None) -> int:
    """The one pass's row chunks per segment (at most; `tuned`: the configs'
    "lora_train_dx_term_da_bwd", device's by default): lean_max_chunks where the kernel is its `lean`
    form (a 16-bit term, dS in one 16-bit half) and that grid (segments x chunks x column tiles)
    still fits `per_sm` programs per SM, else max_chunks. Its small tiles keep few bytes in flight
    per program, so programs resident on every SM are what hide the latency; past one wave, more
    chunks only add partial sums."""
    tuned = tuned or train_configs(device)["lora_train_dx_term_da_bwd"]
    if not lean:  # the engine's form, on its backward's path: nothing to work out
        return tuned["max_chunks"]
    doubled = tuned["lean_max_chunks"] * meta.num_segments * -(-in_size // block_k)  # plain ints: no triton.cdiv call
    return tuned["lean_max_chunks"] if doubled <= target_programs(device, per_sm) else tuned["max_chunks"]


def lora_train_dx_term_da_bwd(x: torch.Tensor, ds: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta,
                              slots: LoRATrainSlots, seed: int, *, out_dtype: torch.dtype | None = None,
                              split_ds: bool = False, x_dropped: bool = False, da_out: torch.Tensor | None = None,
                              block_m: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                              num_stages: int = 3, per_sm: int | None = None,
                              max_chunks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernels 4's term and 5 in one pass: (term, dA). term [T, in] = dropout'(dS A[slot]) per
    token in `out_dtype` (x's by default; zero rows without an adapter), for dX = dY W + term;
    dA, `split_ds` and `da_out` as in `lora_train_da_bwd`. Each [rows, in] tile is read and
    written once and its keep mask hashed once, where the two kernels each walk all of it.
    `x_dropped`: x is a stored dropout output, taken as it is by dA (the term is masked still).
    The keyword arguments override the tiles, warps, stages and programs per SM (tuning)."""
    check_launchable(x, _lora_train_da_bwd_kernel)
    num_tokens, in_size = x.shape
    max_rank = lora_a.shape[1]
    if ds.shape != (num_tokens, max_rank) or ds.stride(1) != 1 or lora_a.stride(2) != 1:
        raise ValueError(f"dS must be [{num_tokens}, {max_rank}] with unit column stride and lora_a's rows contiguous")
    out_dtype = out_dtype or x.dtype
    if max_rank > MAX_TERM_DA_RANK:
        da_slots = LoRATrainSlots(slots.scalings, torch.zeros_like(slots.dropout_ps), False) if x_dropped else slots
        da = lora_train_da_bwd(x, ds, lora_a, meta, da_slots, seed, split_ds=split_ds, da_out=da_out)
        return lora_train_dx_term(ds, lora_a, meta, slots, seed, out_dtype=out_dtype, split_ds=split_ds), da
    alloc = torch.empty if meta.covers_all_tokens else torch.zeros
    term = alloc(num_tokens, in_size, dtype=out_dtype, device=x.device)
    if not meta.has_lora:
        return term, (torch.zeros_like(lora_a) if da_out is None else da_out)
    configs = train_configs(x.device)
    tuned = configs["lora_train_dx_term_da_bwd"]
    tiles = term_da_tiles(max_rank, configs) if x.device.type == "cuda" else (16, 32, 4)
    block_m, block_k, num_warps = block_m or tiles[0], block_k or tiles[1], num_warps or tiles[2]
    per_sm = per_sm or by_rank(tuned["by_rank"], max_rank)["per_sm"]
    split_ds = split_ds and x.dtype != torch.float32
    max_chunks = max_chunks or term_da_chunks(meta, in_size, block_k, x.device, per_sm,
                                              lean=not split_ds and out_dtype.itemsize == 2, tuned=tuned)
    rows_per_chunk, num_chunks, k_per_split, num_splits = chunk_plan(meta, in_size, block_m, block_k, x.device,
                                                                     per_sm, max_chunks)
    da_part = torch.empty(meta.num_segments * num_chunks, max_rank, in_size, dtype=torch.float32, device=x.device)
    _lora_train_da_bwd_kernel[(meta.num_segments, num_chunks, num_splits)](
        x, ds, lora_a, term, da_part, meta.seg_starts, meta.seg_lens, meta.seg_slots, slots.dropout_ps,
        in_size, max_rank, kernel_seed(seed), rows_per_chunk, k_per_split, num_chunks,
        x.stride(0), ds.stride(0), lora_a.stride(0), lora_a.stride(1), term.stride(0), da_part.stride(0),
        da_part.stride(1),
        WITH_TERM=True, HAS_DROPOUT=slots.has_dropout, MASK_X=not x_dropped,
        SPLIT_DS=split_ds, BLOCK_M=block_m, BLOCK_K=block_k,
        BLOCK_R=rank_block(max_rank), num_warps=num_warps, num_stages=num_stages,
    )
    da = torch.empty_like(lora_a) if da_out is None else da_out
    _reduce_by_slot(da_part, da, meta, rows_per_chunk, num_chunks, accumulate=da_out is not None)
    return term, da


def lora_train_dx_term(ds: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta, slots: LoRATrainSlots,
                       seed: int, *, out_dtype: torch.dtype = torch.float32, split_ds: bool = False,
                       blocks: tuple[int, int] | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Kernel 4's LoRA term alone: [T, in] = dropout'(dS A[slot]) per token (zero rows without an
    adapter), in `out_dtype`, for a caller that adds dY W itself (the fine-tuning engine adds it in
    its dX GEMM's epilogue). `lora_train_dx_term_da_bwd` runs it with dA in one pass up to
    MAX_TERM_DA_RANK and calls this above. `split_ds` as in `lora_train_da_bwd`. Fixed blocks (by
    rank unless given), no autotuning: the engine calls this with every window length and must
    not stop to tune."""
    check_launchable(ds, _lora_train_dx_bwd_kernel)
    num_tokens, in_size, max_rank = ds.shape[0], lora_a.shape[2], lora_a.shape[1]
    if ds.shape[1] != max_rank or ds.stride(1) != 1 or lora_a.stride(2) != 1:
        raise ValueError(f"dS must be [T, {max_rank}] with unit column stride and lora_a's rows contiguous")
    term = torch.empty(num_tokens, in_size, dtype=out_dtype, device=ds.device)
    if num_tokens == 0:
        return term
    if not meta.has_lora:
        return term.zero_()
    # Tiles small enough to leave several programs per SM; a wider one above rank 64, where the
    # small tile spills (ptxas, sm_90, triton 3.9).
    block_m, block_n, num_warps = term_tiles("lora_train_dx_term", max_rank, ds.device, blocks, num_warps)
    grid = (triton.cdiv(num_tokens, block_m) * triton.cdiv(in_size, block_n),)
    _lora_train_dx_bwd_kernel[grid](
        ds, lora_a, term, token_segments(meta), meta.seg_starts, meta.seg_lens, meta.seg_slots,
        slots.dropout_ps, num_tokens, in_size, max_rank, kernel_seed(seed), triton.next_power_of_2(num_tokens),
        ds.stride(0), lora_a.stride(0), lora_a.stride(1), term.stride(0),
        HAS_DROPOUT=slots.has_dropout, SPLIT_DS=split_ds and lora_a.dtype != torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=16, BLOCK_R=rank_block(max_rank), GROUP_M=4,
        num_warps=num_warps, num_stages=1,
    )
    return term

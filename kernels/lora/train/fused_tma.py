"""Kernel 2 of the fused LoRA training linear with the frozen GEMM in Triton over TMA
(base_gemm="tma"): LoRAFusion's literal form, where the LoRA product joins the GEMM's own
accumulator, on Hopper's bulk tensor copies.

    kernel 2: y  = x W^T + scaling * S B^T          (fused.add_lora_fwd_term)

The main loop reads their operand tiles through tensor descriptors (`TensorDescriptor`: on sm_90
the copy engine fills shared memory, no per-thread address arithmetic or masks) into wgmma; the
grid is persistent (one program per SM walking the output tiles in grouped order), the epilogue
is the same LoRA code as the pointer forms, and the tile is written once through a descriptor.
Kernel 2 splits the tiles of a last round that would leave SMs idle over K (`tail_plan`: a
stream-K-style tail whose parts sum through fp32 partials, the last part to arrive in fixed
order, no program waiting), which took 2048 x 5120 from 1.21x to 1.11x cuBLAS's time on an
H200 (docs/benchmarks.md).
Compared with base_gemm="blas" (cuBLAS with the LoRA term as its C operand) this saves the term's
write and read, [T, out] in 16 bits; it only pays where this GEMM keeps up with cuBLAS
(`linear.timed_forward_form` picks per shape; docs/benchmarks.md says where it did).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flexserve_kernels.lora.train.configs import CONFIGS_DIR, train_configs
from flexserve_kernels.lora.train.fused import (
    add_lora_fwd_term,
    gemm_configs,
    grouped_tile,
    launch_scratch,
    rank_block,
)
from flexserve_kernels.tuned_configs import device_name, load_configs

# Kernel 2's tail split (`tail_plan`): at most MAX_TAIL_SPLIT K parts per tail tile, each at least
# MIN_PART_K_BLOCKS steps of BLOCK_K (the launchers' default; the interpreter's tests take 1, to
# split their small K).
MAX_TAIL_SPLIT = tl.constexpr(4)
MIN_PART_K_BLOCKS = 16
# The partial tiles go through memory in this many column parts (registers: see _store_columns).
PART_COLUMN_SPLIT = tl.constexpr(2)


@triton.jit
def _lora_train_linear_fwd_tma_kernel(
    x_desc, w_desc, y_desc, s_ptr, b_ptr, token_slots_ptr, token_segs_ptr, seg_starts_ptr, seg_lens_ptr,
    seg_slots_ptr, scalings_ptr, part_ptr, count_ptr, M, N, K, max_rank, m_bucket, stride_sm, stride_bs, stride_bn,
    num_programs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr,
    MIN_PART: tl.constexpr,
):
    # Persistent: program p takes work items p, p + num_programs, ... (m_bucket is only the
    # autotuner's key). The items are the output tiles in grouped order, except that the tiles of
    # a last round that would leave SMs idle are split over K (`tail_plan`): each part stores its
    # fp32 partial tile in part (one [BLOCK_M, BLOCK_N] block per item) and counts itself in on
    # the tile's counter; the last of the tile's parts to arrive sums the partials in part order
    # (bitwise reproducible whatever the arrival order), resets the counter and runs the epilogue.
    # No program waits for another. x [M, K] and W [N, K] are read as [BLOCK_M, BLOCK_K] /
    # [BLOCK_N, BLOCK_K]. WARP_SPECIALIZE: a producer warp issues the TMA copies while the consumer
    # warp groups run wgmma and the epilogue (Triton's Hopper warp specialization; 8 warps).
    # EPILOGUE_SPLIT 2: the tile is stored in two column halves (y_desc's block is half the tile),
    # so its staging buffer takes half the shared memory and a fourth pipeline stage fits beside
    # 128 x 256 tiles.
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_blocks = tl.cdiv(K, BLOCK_K)
    whole, tail, split = tail_plan(num_tiles, num_programs, k_blocks, MIN_PART)
    k_part = tl.cdiv(k_blocks, split) * BLOCK_K
    num_items = whole + (num_tiles - whole) * split
    for item in tl.range(tl.program_id(0), num_items, num_programs, warp_specialize=WARP_SPECIALIZE):
        tile = item
        k_begin = 0
        k_end = K
        last = item < whole
        if item >= whole:  # a K part of a tail tile: item - whole = part * tail + tail index
            tile = whole + (item - whole) % tail
            k_begin = (item - whole) // tail * k_part
            k_end = min(K, k_begin + k_part)
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_begin, k_end, BLOCK_K):
            x_tile = x_desc.load([off_m, k])
            w_tile = w_desc.load([off_n, k])
            acc = tl.dot(x_tile, w_tile.T, acc, input_precision="ieee")
        if item >= whole:
            acc, last = _sum_tail_parts(acc, part_ptr, count_ptr, item - whole, tail, split)
        if last:
            rows = off_m + tl.arange(0, BLOCK_M)
            cols = off_n + tl.arange(0, BLOCK_N)
            acc = add_lora_fwd_term(acc, rows, cols, M, N, s_ptr, b_ptr, token_slots_ptr, token_segs_ptr,
                                    seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, scalings_ptr, max_rank, stride_sm,
                                    stride_bs, stride_bn, BLOCK_R)
            _store_parts(acc, y_desc, off_m, off_n, EPILOGUE_SPLIT)


@triton.jit
def tail_plan(num_tiles, num_programs, k_blocks, MIN_PART: tl.constexpr):
    """(whole, tail, split) of a persistent GEMM's num_tiles output tiles on num_programs
    programs: the first `whole` tiles run whole, the last `tail` (the last round's, fewer than
    num_programs) in `split` K parts each, as many as the idle programs allow (tail * split <=
    num_programs), at most MAX_TAIL_SPLIT and each part at least MIN_PART of the k_blocks steps; split
    1 (whole = num_tiles) when the round is full or no split fits."""
    tail = num_tiles % num_programs
    split = 1
    if tail > 0:
        split = max(1, min(min(num_programs // tail, MAX_TAIL_SPLIT), k_blocks // MIN_PART))
    whole = num_tiles
    if split > 1:
        whole = num_tiles - tail
    return whole, tail, split


@triton.jit
def _tail_plan_kernel(out_ptr, num_tiles, num_programs, k_blocks, MIN_PART: tl.constexpr):
    whole, tail, split = tail_plan(num_tiles, num_programs, k_blocks, MIN_PART)
    tl.store(out_ptr, whole)
    tl.store(out_ptr + 1, tail)
    tl.store(out_ptr + 2, split)


def tail_plan_of(num_tiles: int, num_programs: int, k_blocks: int, min_part: int = MIN_PART_K_BLOCKS,
                 device: torch.device | str = "cuda") -> tuple[int, int, int]:
    """`tail_plan`'s (whole, tail, split) as kernel 2 computes it, from a one-program launch on
    `device` (the benchmark records each shape's; the tests check the rule)."""
    out = torch.empty(3, dtype=torch.int32, device=device)
    _tail_plan_kernel[(1,)](out, num_tiles, num_programs, k_blocks, MIN_PART=min_part)
    whole, tail, split = out.tolist()
    return whole, tail, split


def last_forward_plan(num_tokens: int, out_size: int, in_size: int, device: torch.device) -> dict:
    """Kernel 2's tiles as the autotuner picked them for its last CUDA launch (call right after
    the launch at this shape) and the `tail_plan` they give here: the benchmark's record."""
    c = fwd_tma_tuned(device).best_config
    bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
    tiles = triton.cdiv(num_tokens, bm) * triton.cdiv(out_size, bn)
    whole, tail, split = tail_plan_of(tiles, _num_sms(device), triton.cdiv(in_size, bk), device=device)
    return dict(tiles=f"{bm}x{bn}x{bk}", stages=c.num_stages, warp_specialize=c.kwargs["WARP_SPECIALIZE"],
                epilogue_split=c.kwargs["EPILOGUE_SPLIT"], tail_tiles=tail if split > 1 else 0, tail_split=split)


@triton.jit
def _sum_tail_parts(acc, part_ptr, count_ptr, index, tail, split):
    """Kernel 2's fix-up of the K part `index` (= part * tail + tile) of a tail tile, acc being its
    partial: store it in part (fp32, [BLOCK_M, BLOCK_N] per index), count in on the tile's counter,
    and, for the last part to arrive, the tile's sum of every part's partial in part order, the
    counter reset to 0. Returns (acc, whether this part is the last)."""
    tile_elems: tl.constexpr = acc.shape[0] * acc.shape[1]
    _store_columns(part_ptr + index.to(tl.int64) * tile_elems, acc, acc.shape[1], PART_COLUMN_SPLIT)
    # Every thread's partial stores before the counter's release (one thread issues the scalar
    # atomic), as in kernel 1's split-K and CUTLASS's semaphore.
    tl.debug_barrier()
    tile = index % tail
    last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == split - 1
    if last:
        acc = _sum_columns(part_ptr + tile.to(tl.int64) * tile_elems, tail * tile_elems, split, acc.shape[0],
                           acc.shape[1], acc.shape[1], PART_COLUMN_SPLIT)
        tl.store(count_ptr + tile, 0)  # ready for the next launch (cached counters)
    return acc, last


@triton.jit
def _store_columns(ptr, tile, row_stride: tl.constexpr, PARTS: tl.constexpr):
    """Store the 2-D tile at ptr (rows row_stride elements apart) in PARTS column parts (a power
    of two), one after the other: a part's addresses take a PARTS-th of the registers."""
    if PARTS == 1:
        offs = tl.arange(0, tile.shape[0])[:, None] * row_stride + tl.arange(0, tile.shape[1])[None, :]
        tl.store(ptr + offs, tile)
    else:
        left, right = _column_halves(tile)
        _store_columns(ptr, left, row_stride, PARTS // 2)
        _store_columns(ptr + left.shape[1], right, row_stride, PARTS // 2)


@triton.jit
def _sum_columns(ptr, stride, count, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, row_stride: tl.constexpr,
                 PARTS: tl.constexpr):
    """The sum, in order, of the `count` fp32 [BLOCK_M, BLOCK_N] tiles at ptr, ptr + stride, ...
    (rows row_stride elements apart), read in PARTS column parts (as `_store_columns` wrote
    them) through L2 (.cg: never a stale L1 line of another program's store)."""
    if PARTS == 1:
        offs = tl.arange(0, BLOCK_M)[:, None] * row_stride + tl.arange(0, BLOCK_N)[None, :]
        total = tl.load(ptr + offs, cache_modifier=".cg")
        for i in range(1, count):
            total += tl.load(ptr + i * stride + offs, cache_modifier=".cg")
        return total
    else:
        left = _sum_columns(ptr, stride, count, BLOCK_M, BLOCK_N // 2, row_stride, PARTS // 2)
        right = _sum_columns(ptr + BLOCK_N // 2, stride, count, BLOCK_M, BLOCK_N // 2, row_stride, PARTS // 2)
        return tl.reshape(tl.permute(tl.join(left, right), (0, 2, 1)), (BLOCK_M, BLOCK_N))


@triton.jit
def _store_parts(acc, desc, off_m, off_n, PARTS: tl.constexpr):
    """Store the tile acc at [off_m, off_n] through desc, whose block is one of PARTS column parts
    (a power of two), one part after the other."""
    if PARTS == 1:
        desc.store([off_m, off_n], acc.to(desc.dtype))
    else:
        left, right = _column_halves(acc)
        _store_parts(left, desc, off_m, off_n, PARTS // 2)
        _store_parts(right, desc, off_m, off_n + left.shape[1], PARTS // 2)


@triton.jit
def _column_halves(acc):
    """The left and right column halves of a 2-D tile."""
    return tl.split(tl.permute(tl.reshape(acc, (acc.shape[0], 2, acc.shape[1] // 2)), (0, 2, 1)))


# Hopper (sm_90) autotune candidates: the configs file's "lora_train_linear_fwd_tma". None may
# spill up to rank 32 (ptxas, sm_90, triton 3.9, bf16) and each must fit the 227 KB of shared
# memory; above rank 32 every one spilled, hence MAX_TMA_RANK. Hopper warp specialization fails to
# compile at 4 warps, so only 8-warp candidates take it. The last candidate must be one that fp32
# operands fit (`_fits_shared_memory`).
MAX_TMA_RANK = 32


def _block_shape(values: dict, operand: tuple[str, ...]) -> list[int]:
    """The block of one descriptor: operand is (argument, row block name, column block name[, name
    of the count the columns are split into]), values the launch's constexprs."""
    _, rows, cols, *split = operand
    return [values[rows], values[cols] // (values[split[0]] if split else 1)]


def _set_blocks(operands: tuple[tuple[str, ...], ...]):
    """An autotuner pre_hook that sets each descriptor's block shape from the config's blocks."""

    def hook(nargs):
        for operand in operands:
            nargs[operand[0]].block_shape = _block_shape(nargs, operand)

    return hook


_FWD_EXTRAS = ("warp_specialize", "epilogue_split")


def _configs(candidates: list[dict], operands, extras) -> list[triton.Config]:
    """triton.Configs of a configs file's candidates (`gemm_configs`, with the constexprs named in
    `extras`), each with a pre_hook that sets the descriptors' blocks."""
    hook = _set_blocks(operands)
    configs = gemm_configs(candidates, extras)
    for c in configs:
        c.pre_hook = hook
    return configs


_FWD_OPERANDS = (("x_desc", "BLOCK_M", "BLOCK_K"), ("w_desc", "BLOCK_N", "BLOCK_K"),
                 ("y_desc", "BLOCK_M", "BLOCK_N", "EPILOGUE_SPLIT"))


def _fits_shared_memory(configs, named_args, **kwargs):
    """The autotuner's `early_config_prune`: the candidates whose pipeline buffers (num_stages
    pairs of operand tiles) and output staging tile fit the GPU's shared memory at the operands'
    element size (the last candidate when none does). Before it, fp32 operands overflowed every
    candidate, and the autotuner, all its times infinite, launched one that failed."""
    first = named_args[next(name for name in named_args if name.endswith("_desc"))]
    size = first.base.element_size()
    limit = torch.cuda.get_device_properties(first.base.device).shared_memory_per_block_optin
    fitting = []
    for c in configs:
        m, n, k = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        staging = m * n // c.kwargs.get("EPILOGUE_SPLIT", 1)
        if (c.num_stages * (m + n) * k + staging) * size <= limit:
            fitting.append(c)
    return fitting or configs[-1:]


_TUNE_KEY = ["m_bucket", "N", "K", "max_rank"]


@functools.cache
def _fwd_tuner(name: str | None):
    candidates = load_configs(CONFIGS_DIR, name)["lora_train_linear_fwd_tma"]["candidates"]
    return triton.autotune(configs=_configs(candidates, _FWD_OPERANDS, _FWD_EXTRAS), key=_TUNE_KEY,
                           prune_configs_by={"early_config_prune": _fits_shared_memory})(
        _lora_train_linear_fwd_tma_kernel)


def fwd_tma_tuned(device: torch.device):
    """Kernel 2 over TMA autotuned over the candidates of device's configs file (one autotuner per
    GPU name)."""
    return _fwd_tuner(device_name(device))


def largest_fwd_tile(device: torch.device) -> int:
    """The most elements of one output tile among device's candidates (the tail's partial tiles)."""
    candidates = train_configs(device)["lora_train_linear_fwd_tma"]["candidates"]
    return max(c["block_m"] * c["block_n"] for c in candidates)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _descriptor(t: torch.Tensor, block: tuple[int, int]) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))


def tma_supported(*tensors: torch.Tensor) -> bool:
    """Whether base_gemm="tma" can take these 2-D operands: rows 16-byte aligned (TMA's rule) and a
    GPU of compute capability 9.0 or newer, or Triton's interpreter on CPU."""
    if any(t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16 or t.stride(-1) != 1 for t in tensors):
        return False
    device = tensors[0].device
    return device.type == "cpu" or torch.cuda.get_device_capability(device)[0] >= 9


def tma_forward_runs(x: torch.Tensor, weight: torch.Tensor, max_rank: int) -> bool:
    """Whether kernel 2 over TMA runs on a CUDA GPU for x [T, in] and weight [out, in] at this rank
    (`_check_supported`'s conditions, y [T, out] included); False on CPU, where it would only run
    in the interpreter."""
    out_bytes = weight.shape[0] * x.element_size()
    return x.is_cuda and max_rank <= MAX_TMA_RANK and out_bytes % 16 == 0 and tma_supported(x, weight)


def _check_supported(max_rank: int, *tensors: torch.Tensor) -> None:
    if max_rank > MAX_TMA_RANK:
        raise ValueError(f"base_gemm='tma' takes ranks up to {MAX_TMA_RANK}, got {max_rank} (use base_gemm='blas')")
    if not tma_supported(*tensors):
        raise ValueError("base_gemm='tma' needs a GPU of compute capability >= 9.0 and operands whose rows "
                         "start at 16-byte boundaries (use base_gemm='blas')")


def _launch(kernel, tuned_kernel, operands, tensors, rest, num_rows, num_cols, max_rank, blocks, untuned=None,
            every_sm=False, **consts) -> None:
    """Launch one of the TMA kernels: descriptors of `tensors` (in `operands`' order and blocks),
    then the `rest` of its arguments, on a persistent grid of one program per SM (`every_sm`:
    kernel 2, whose split tail tiles may give every program an item) or of at most one per SM
    and one per output tile of num_rows x num_cols. Autotuned on CUDA unless `blocks` = (BLOCK_M, BLOCK_N,
    BLOCK_K) is given (the interpreter's tests; `untuned` holds that launch's other tile
    constexprs); the autotuner's pre_hook sets each config's descriptor blocks, so the ones built
    here are placeholders then."""
    device = tensors[0].device
    tuned = device.type == "cuda" and blocks is None
    bm, bn, bk = (64, 64, 64) if tuned else blocks or (16, 32, 32)
    sizes = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **({} if tuned else untuned or {})}
    descs = [_descriptor(t, _block_shape({"EPILOGUE_SPLIT": 1, **sizes}, op)) for t, op in zip(tensors, operands)]
    programs = _num_sms(device)
    args = (*descs, *rest, programs)
    consts["BLOCK_R"] = rank_block(max_rank)

    def grid(c):
        return (programs if every_sm else min(programs, triton.cdiv(num_rows, c["BLOCK_M"]) *
                                              triton.cdiv(num_cols, c["BLOCK_N"])),)

    if tuned:
        tuned_kernel[grid](*args, **consts)
        return
    kernel[grid(sizes)](*args, **sizes, GROUP_M=4, num_warps=4, num_stages=3, **consts)


def linear_fwd_tma(x, weight, s, lora_b, y, token_segs, meta, slots, blocks=None, epilogue_split=1,
                   min_part_k_blocks=MIN_PART_K_BLOCKS) -> None:
    """Kernel 2 with the GEMM over TMA into y [T, out]; tiles as in `_launch`, tail tiles split
    over K in parts of at least `min_part_k_blocks` steps (`tail_plan`), and with `blocks` the
    store in `epilogue_split` column parts (1 or 2), without warp specialization."""
    _check_supported(lora_b.shape[2], x, weight, y)
    num_tokens, in_size = x.shape
    out_size, max_rank = lora_b.shape[1], lora_b.shape[2]
    # The tail's fp32 partials: one tile per program at most (tail * split <= programs), of the
    # largest candidate tile when autotuned.
    programs = _num_sms(x.device)
    tile = blocks[0] * blocks[1] if blocks else largest_fwd_tile(x.device)
    part = launch_scratch("tma_tail_parts", x.device, programs * tile, torch.float32)
    counters = launch_scratch("tma_tail", x.device, programs)
    rest = (s, lora_b, meta.token_slots, token_segs, meta.seg_starts, meta.seg_lens, meta.seg_slots, slots.scalings,
            part, counters, num_tokens, out_size, in_size, max_rank,
            triton.next_power_of_2(num_tokens), s.stride(0), lora_b.stride(0), lora_b.stride(1))
    _launch(_lora_train_linear_fwd_tma_kernel, fwd_tma_tuned(x.device), _FWD_OPERANDS, (x, weight, y), rest, num_tokens,
            out_size, max_rank, blocks, untuned=dict(WARP_SPECIALIZE=False, EPILOGUE_SPLIT=epilogue_split),
            every_sm=True, MIN_PART=min_part_k_blocks)

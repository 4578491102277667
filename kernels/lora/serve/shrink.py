"""LoRA shrink, s[t] = x[t] @ lora_a[slot(t)].T, as SGMV (same-adapter segments) and BGMV (per token).

Both return a new float32 s with every row written, zero for tokens without an adapter. s is
T x max_rank x 4 bytes (128 KiB at 2048 tokens, rank 16), nothing next to reading x, and float32
keeps the fp32 path exact; a 16-bit expand rounds it once, to the weights' dtype, for its dot.

The shrink's output is narrow (N = rank), so parallelism has to come from tokens or from K:
SGMV splits K when its token tiles cannot fill the GPU and sums the splits in a second, fixed-order
kernel (deterministic, unlike vLLM's atomics); BGMV gives each program a few rank rows of one token.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
from flexserve_kernels.lora.serve.ref import check_shrink_args


@triton.jit(do_not_specialize=["split_k"])  # one kernel whatever split_k (1, 16k, other)
def _lora_shrink_sgmv_kernel(
    x_ptr, a_ptr, out_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, tile_map_ptr,
    hidden_size, max_rank, k_per_split, split_k, num_map_tiles,
    stride_xm, stride_as, stride_ar, stride_os, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_TILE_MAP: tl.constexpr,
):
    # Grid: (segment, token tile, rank tile x K split). Token tiles past a segment's end exit here,
    # so one grid serves segments of any length. split_k is a runtime value, not a constexpr: it
    # follows the token count (1 to 112 on Llama-3.1-8B), and as a constexpr each value compiled
    # its own kernel (14 of them in a 20 s fine-tuning run on a cold H200, ~1 s each, stalling
    # every request in those iterations).
    # With a tile map (CUDA graphs: the grid is fixed by the bucket, not by the batch) the grid is
    # (map entry, rank tile x K split) and entry i names its segment and token tile; -1 is empty.
    if USE_TILE_MAP:
        seg = tl.load(tile_map_ptr + tl.program_id(0))
        if seg < 0:
            return
        pid_m = tl.load(tile_map_ptr + num_map_tiles + tl.program_id(0))
        pid_rk = tl.program_id(1)
    else:
        seg = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_rk = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    pid_r = pid_rk // split_k
    pid_k = pid_rk % split_k

    # 64-bit scalar bases, 32-bit offsets within the tile: int64 offset tensors cost registers
    # (ptxas, sm_90, triton 3.9: the 64 x 16 bf16 tile took 208 registers that way, 150 this way).
    m_start = pid_m * BLOCK_M
    k_start = pid_k * k_per_split
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < seg_len - m_start
    r_mask = offs_r < max_rank - pid_r * BLOCK_R
    x_base = x_ptr + (seg_start + m_start).to(tl.int64) * stride_xm + k_start
    # lora_a[slot] is [max_rank, in]; read it as its transpose [BLOCK_K, BLOCK_R] for the dot.
    a_base = a_ptr + slot * stride_as + (pid_r * BLOCK_R).to(tl.int64) * stride_ar + k_start
    x_offs = offs_m[:, None] * stride_xm + offs_k[None, :]
    a_offs = offs_r[None, :] * stride_ar + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        k_mask = offs_k < hidden_size - k_start - k
        x_tile = tl.load(x_base + x_offs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a_tile = tl.load(a_base + a_offs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        # ieee keeps float32 inputs exact (no TF32); 16-bit inputs take tensor cores either way.
        acc = tl.dot(x_tile, a_tile, acc, input_precision="ieee")
        x_base += BLOCK_K
        a_base += BLOCK_K
    out_base = out_ptr + pid_k.to(tl.int64) * stride_os + (seg_start + m_start).to(tl.int64) * stride_om
    out_base += pid_r * BLOCK_R
    tl.store(out_base + offs_m[:, None] * stride_om + offs_r[None, :], acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _lora_shrink_reduce_kernel(
    partial_ptr, s_ptr, token_slots_ptr,
    num_tokens, max_rank, split_k,
    stride_ps, stride_pm, stride_sm,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # Sums the K splits in a fixed order (deterministic, unlike atomics) and writes every row of s,
    # zero for tokens without an adapter (their partial rows were never written).
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    t_mask = offs_t < num_tokens
    slots = tl.load(token_slots_ptr + offs_t, mask=t_mask, other=-1)
    rows = offs_t.to(tl.int64)
    mask = t_mask[:, None] & (offs_r < max_rank)[None, :]
    read_mask = mask & (slots >= 0)[:, None]
    p_ptrs = partial_ptr + rows[:, None] * stride_pm + offs_r[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for _split in range(0, split_k):
        acc += tl.load(p_ptrs, mask=read_mask, other=0.0)
        p_ptrs += stride_ps
    tl.store(s_ptr + rows[:, None] * stride_sm + offs_r[None, :], acc, mask=mask)


@triton.jit
def _lora_shrink_bgmv_kernel(
    x_ptr, a_ptr, s_ptr, token_slots_ptr,
    hidden_size, max_rank,
    stride_xm, stride_as, stride_ar, stride_sm,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Grid: (token, rank tile). Parallel over rank rows rather than over K, so each output is one
    # program's fixed-order sum (deterministic, no atomics, no zeroed output).
    token = tl.program_id(0).to(tl.int64)
    pid_r = tl.program_id(1)
    slot = tl.load(token_slots_ptr + token)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < max_rank - pid_r * BLOCK_R
    s_ptrs = s_ptr + token * stride_sm + pid_r * BLOCK_R + offs_r
    if slot < 0:
        tl.store(s_ptrs, tl.zeros((BLOCK_R,), dtype=tl.float32), mask=r_mask)
        return
    offs_k = tl.arange(0, BLOCK_K)
    x_base = x_ptr + token * stride_xm
    a_base = a_ptr + slot.to(tl.int64) * stride_as + (pid_r * BLOCK_R).to(tl.int64) * stride_ar
    a_offs = offs_r[:, None] * stride_ar + offs_k[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k in range(0, hidden_size, BLOCK_K):
        k_mask = offs_k < hidden_size - k
        x_vec = tl.load(x_base + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        a_tile = tl.load(a_base + a_offs, mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += a_tile * x_vec[None, :]
        x_base += BLOCK_K
        a_base += BLOCK_K
    tl.store(s_ptrs, tl.sum(acc, axis=1), mask=r_mask)


def lora_shrink_sgmv(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    meta: LoRAKernelMeta,
    *,
    block_m: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """SGMV shrink over meta's segments: s [T, max_rank] float32, zero rows for base tokens.

    Block sizes and the K split are picked from the shapes; the keywords override them (tests).
    """
    check_shrink_args(x, lora_a, meta)
    check_launchable(x, _lora_shrink_sgmv_kernel)
    num_tokens, hidden_size = x.shape
    max_rank = lora_a.shape[1]
    if not meta.has_lora:
        return torch.zeros(num_tokens, max_rank, dtype=torch.float32, device=x.device)

    # tl.dot needs every dimension >= 16: ranks below 16 are padded (masked) to 16. One rank tile
    # up to rank 128 reads x once; larger ranks take several tiles, each reading x again.
    block_r = min(max(16, triton.next_power_of_2(max_rank)), 128)
    # 64 x 16-bit = 128 bytes per row per step; float32 halves it to keep shared memory the same.
    block_k = block_arg("block_k", block_k, 16) or (32 if x.dtype == torch.float32 else 64)
    num_r_tiles = triton.cdiv(max_rank, block_r)
    target = target_programs(x.device)
    # The output is tiny (N = rank), so the grid has few tiles unless there are many tokens. Fill
    # the SMs (about two programs each) first with token tiles: a whole short segment, at most 64
    # rows (each A tile then serves 64 tokens), halved down to 16 while even the largest K split
    # (>= 128 inputs each, so partials stay small) would leave SMs idle; then split K.
    max_split = triton.cdiv(hidden_size, 128)
    if meta.tile_map is not None:
        block_m = meta.tile_block_m
    elif block_m is None:
        block_m = min(max(16, triton.next_power_of_2(meta.max_seg_len)), 64)
        while block_m > 16 and busy_tiles(meta, block_m) * num_r_tiles * max_split < target:
            block_m //= 2
    else:
        block_arg("block_m", block_m, 16)
    if split_k is None:
        split_k = max(1, min(target // (busy_tiles(meta, block_m) * num_r_tiles), max_split))
    elif split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    k_per_split = triton.cdiv(triton.cdiv(hidden_size, split_k), block_k) * block_k
    split_k = triton.cdiv(hidden_size, k_per_split)  # no empty splits

    s = (torch.zeros if split_k == 1 else torch.empty)(num_tokens, max_rank, dtype=torch.float32, device=x.device)
    out = s if split_k == 1 else torch.empty(split_k, num_tokens, max_rank, dtype=torch.float32, device=x.device)
    tile_map, num_map_tiles = tile_map_args(meta)
    if tile_map is None:
        grid = (meta.num_segments, triton.cdiv(meta.max_seg_len, block_m), num_r_tiles * split_k)
    else:
        grid = (num_map_tiles, num_r_tiles * split_k)
    _lora_shrink_sgmv_kernel[grid](
        x, lora_a, out, meta.seg_starts, meta.seg_lens, meta.seg_slots,
        meta.seg_lens if tile_map is None else tile_map,  # any pointer when unused
        hidden_size, max_rank, k_per_split, split_k, num_map_tiles,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0) if split_k > 1 else 0, out.stride(-2),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, USE_TILE_MAP=tile_map is not None,
        # ptxas (sm_90, triton 3.9): a 64 x 64 tile takes 245 registers at 4 warps, 128 at 8;
        # 64 x 128 spills at 4 warps. 8 warps from 4096 accumulator elements.
        num_warps=8 if block_m * block_r >= 4096 else 4, num_stages=3,
    )
    if split_k > 1:
        reduce_r = triton.next_power_of_2(max_rank)
        block_t = max(1, min(64, 4096 // reduce_r))
        _lora_shrink_reduce_kernel[(triton.cdiv(num_tokens, block_t),)](
            out, s, meta.token_slots, num_tokens, max_rank, split_k,
            out.stride(0), out.stride(1), s.stride(0),
            BLOCK_T=block_t, BLOCK_R=reduce_r, num_warps=4,
        )
    return s


def lora_shrink_bgmv(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    meta: LoRAKernelMeta,
    *,
    block_r: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """BGMV shrink, one program per (token, rank tile): s [T, max_rank] float32, zero rows for base
    tokens. Reads meta.token_slots only, so it is right for any batch; fast for one-token rows."""
    check_shrink_args(x, lora_a, meta)
    check_launchable(x, _lora_shrink_bgmv_kernel)
    num_tokens, hidden_size = x.shape
    max_rank = lora_a.shape[1]
    rank_pow2 = triton.next_power_of_2(max_rank)
    if block_r is None:
        # Rows of A per program: few at small batch so T x rank/block_r programs fill the SMs
        # (batch 1, rank 16 -> 16 programs of one row), more as the batch grows (x re-read less).
        # At most 64: a [128, 64] tile spills on sm_90 (ptxas, triton 3.9), [64, 64] takes 180
        # registers.
        block_r = triton.next_power_of_2(max(1, num_tokens * max_rank // target_programs(x.device, 4)))
        block_r = min(block_r, rank_pow2, 64)
    else:
        block_arg("block_r", block_r, 1)
    # About 4096 elements (8 KiB of 16-bit A) per loop step: 32 per thread at 4 warps.
    block_k = block_arg("block_k", block_k, 16) or max(64, min(4096 // block_r, triton.next_power_of_2(hidden_size)))
    s = torch.empty(num_tokens, max_rank, dtype=torch.float32, device=x.device)
    grid = (num_tokens, triton.cdiv(max_rank, block_r))
    _lora_shrink_bgmv_kernel[grid](
        x, lora_a, s, meta.token_slots,
        hidden_size, max_rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), s.stride(0),
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
    )
    return s


def tile_map_args(meta: LoRAKernelMeta) -> tuple[torch.Tensor, int] | tuple[None, int]:
    """(the [2, N] tile map, N) of a meta that has one (`LoRAKernelMeta.tile_map`), else (None, 0)."""
    if meta.tile_map is None:
        return None, 0
    return meta.tile_map, meta.tile_map.shape[1]


def busy_tiles(meta: LoRAKernelMeta, block_m: int) -> int:
    """Token tiles that have work (an upper bound: the grid also holds tiles past segment ends)."""
    if meta.tile_map is not None:
        return meta.tile_map.shape[1]
    tiles_if_all_long = meta.num_segments * triton.cdiv(meta.max_seg_len, block_m)
    return max(1, min(tiles_if_all_long, triton.cdiv(meta.num_tokens, block_m) + meta.num_segments))


def check_launchable(t: torch.Tensor, kernel) -> None:
    """Raise unless `kernel` can run on t's device (CPU needs the interpreter at import time)."""
    if t.device.type == "cpu" and isinstance(kernel, triton.runtime.JITFunction):
        raise RuntimeError(
            "LoRA Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
            f"{__name__} is imported (Triton picks the interpreter when it decorates the kernel)"
        )


def target_programs(device: torch.device, per_sm: int = 2) -> int:
    """Programs that keep every SM busy; a fixed small grid under the CPU interpreter."""
    if device.type != "cuda":
        return 8 * per_sm
    return per_sm * _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def block_arg(name: str, value: int | None, minimum: int) -> int | None:
    if value is not None and (value < minimum or value & (value - 1)):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")
    return value

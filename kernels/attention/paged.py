"""Varlen causal attention over a paged KV cache: prefill, chunked prefill, fine-tuning windows.

Row b has q_b new tokens, flat query rows [query_start_loc[b], query_start_loc[b+1]), at
positions [seq_len_b - q_b, seq_len_b); token i of the row sees keys [0, seq_len_b - q_b + i].
Every key, the context's and the row's own new ones, is read from the paged cache through the
row's block table: the layer writes the new K/V (kv_cache_write) before attending, as the torch
path in flexserve.layers.attention does, so rows can read blocks other rows wrote this step.

Grid (query head, query tile, row), flash-attention style: a program holds BLOCK_M queries of one
head, walks the keys in BLOCK_N tiles with an online softmax in fp32 (exp2, scale folded in),
first the tiles every query of the tile sees in full (no masks), then the few diagonal tiles with
the causal and length masks. Tiles past a row's end exit at once, so the grid needs only the
host-side max_query_len. Query tiles run heaviest first (the last tile of a row sees the most
keys). `paged_attention` sends one-token rows of a mixed batch to decode_attention's split-K
kernel instead, where all query heads of a kv head share one pass over K/V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flexserve_kernels.attention.decode import (
    LOG2E,
    _block_arg,
    attention_rows_ref,
    check_paged_attention_args,
    decode_attention,
)


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, q_pos, start_n, seq_len, table_ptr, k_base, v_base,
    stride_kb, stride_ks, stride_vb, stride_vs, offs_d, scale_log2,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_block = offs_n % BLOCK_SIZE
    if MASKED:
        n_mask = offs_n < seq_len
        block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    else:
        block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
        kv_mask = (offs_n >= 0)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k_ptrs = k_base + (block_ids * stride_kb + in_block * stride_ks)[:, None] + offs_d[None, :]
    if MASKED or HEAD_DIM != BLOCK_D:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
    qk = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_base + (block_ids * stride_vb + in_block * stride_vs)[:, None] + offs_d[None, :]
    if MASKED or HEAD_DIM != BLOCK_D:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, l_i, m_new


# stride_bt (the block tables' row stride, the batch's most blocks per row) is not specialized:
# its divisibility by 16 changes with the batch, and each change compiled a variant mid-serving.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, tile_map_ptr,
    scale_log2, num_map_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SKIP_DECODE_ROWS: tl.constexpr, USE_TILE_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Query heads of one kv head are neighbours in the grid's fastest dimension, so the programs
    # reading the same K/V tiles run together and share them through L2.
    head = tl.program_id(0)
    if USE_TILE_MAP:  # CUDA graphs: a grid fixed by the bucket, (row, tile) per entry, -1 empty
        row = tl.load(tile_map_ptr + tl.program_id(1))
        if row < 0:
            return
        tile = tl.load(tile_map_ptr + num_map_tiles + tl.program_id(1))
    else:
        tile = tl.num_programs(1) - 1 - tl.program_id(1)
        row = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= q_len:
        return
    if SKIP_DECODE_ROWS:
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + row)
    ctx_len = seq_len - q_len
    kv_head = head // QUERIES_PER_KV

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    md_mask = (offs_m < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tokens = q_start.to(tl.int64) + offs_m
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=md_mask, other=0.0)
    q_pos = ctx_len + offs_m
    table_ptr = block_tables_ptr + row.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys [0, ctx_len + m0) are visible to every query of the tile; after them, the diagonal.
    # The first tile processed always has a key each query sees, so m_i is finite from then on
    # and fully masked rows of later diagonal tiles add exp2(-inf) = 0 (no NaN).
    full_end = (ctx_len + m0) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(seq_len, ctx_len + m0 + BLOCK_M)
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, seq_len, table_ptr, k_base, v_base,
            stride_kb, stride_ks, stride_vb, stride_vs, offs_d, scale_log2,
            False, HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D,
        )
    for start_n in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, seq_len, table_ptr, k_base, v_base,
            stride_kb, stride_ks, stride_vb, stride_vs, offs_d, scale_log2,
            True, HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D,
        )
    acc = acc / l_i[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=md_mask)


def _prefill_config(head_dim: int, dtype: torch.dtype, max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the prefill kernel.

    Checked offline for sm_90 (Triton 3.9, cuobjdump): no register spills at these 16-bit
    configs (head_dim 64: 233 registers, 128: 180, 256: 195), 49-98 KiB of shared memory with
    the K/V loads pipelined. Not yet timed on this paged kernel: benchmarks/attention_kernels.py
    --sweep times the alternatives on the GPU.
    """
    block_d = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:
        # Tests only: an fp32 "ieee" dot runs on FMA units, and larger tiles spill.
        block_m, block_n, warps, stages = 32, 16, 8, 1
    elif block_d <= 64:
        block_m, block_n, warps, stages = 128, 64, 4, 3
    elif block_d <= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:
        block_m, block_n, warps, stages = 64, 32, 8, 2
    # Short chunks (speculative or small prefills) would waste most of a 128-query tile.
    short = max(16, triton.next_power_of_2(max_query_len))
    if short < block_m:
        block_m, warps = short, 4
    return block_m, block_n, warps, stages


def prefill_block_m(head_dim: int, dtype: torch.dtype, max_query_len: int) -> int:
    """The query tile height the prefill kernel takes for these shapes on the GPU (tile maps are
    built in tiles of it)."""
    return _prefill_config(head_dim, dtype, max_query_len)[0]


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    skip_decode_rows: bool = False,
    tile_map: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """The prefill kernel alone, for every row (or, with skip_decode_rows, rows with q_b > 1;
    the others' `out` rows are left untouched). Arguments as `paged_attention`; the keywords
    override the block configuration (tests, benchmark sweeps). `tile_map` [2, N] int32
    (`lora_meta.segment_tile_map` of the rows' query lengths in `block_m` tiles, which must be
    given with it) fixes the grid at N query tiles per head whatever the rows (CUDA graphs)."""
    check_paged_attention_args(query, key_cache, value_cache, seq_lens, block_tables,
                               query_start_loc, out)
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if out is None:
        out = torch.empty_like(query)
    num_rows = seq_lens.shape[0]
    if num_rows == 0 or num_tokens == 0:
        return out
    if tile_map is not None and (block_m is None or tile_map.dim() != 2 or tile_map.shape[0] != 2):
        raise ValueError("a tile_map [2, N] needs the block_m it was built with")
    cfg_m, cfg_n, cfg_warps, cfg_stages = _prefill_config(head_dim, query.dtype, max_query_len)
    if query.device.type == "cpu":
        # Triton's interpreter: its cost is per tile step, so take few large steps.
        cfg_m, cfg_n = min(64, max(16, triton.next_power_of_2(max_query_len))), 64
    block_m = _block_arg("block_m", block_m, 16) or cfg_m
    block_n = _block_arg("block_n", block_n, 16) or cfg_n
    if tile_map is None:
        grid = (num_heads, triton.cdiv(max_query_len, block_m), num_rows)
        num_map_tiles = 0
    else:
        num_map_tiles = tile_map.shape[1]
        grid = (num_heads, num_map_tiles)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out,
        query_start_loc, seq_lens, block_tables,
        seq_lens if tile_map is None else tile_map,  # any pointer when unused
        scale * LOG2E, num_map_tiles,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        SKIP_DECODE_ROWS=skip_decode_rows, USE_TILE_MAP=tile_map is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=num_warps or cfg_warps, num_stages=num_stages or cfg_stages,
    )
    return out


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    split_decode_rows: bool = True,
    num_splits: int | None = None,
    prefill_tile_map: torch.Tensor | None = None,
    prefill_block_m: int | None = None,
) -> torch.Tensor:
    """Causal attention of a flat varlen batch over its paged K/V; returns out [T, H, D].

    query [T, H, D] (rows may be strided; last dim contiguous); key_cache / value_cache
    [num_blocks, block_size, KV, D] (kv_cache[0], kv_cache[1]) with H % KV == 0, head_dim in
    [16, 256]; query_start_loc [B+1], seq_lens [B], block_tables [B, max_blocks] (int32 or int64)
    and max_query_len (host int) as in AttentionMetadata. The new tokens' K/V must already be in
    the cache. With max_query_len == 1 this is decode_attention; otherwise the prefill kernel
    runs, and with split_decode_rows (default) one-token rows go to decode_attention's kernel
    (both launches skip the other's rows). num_splits is decode_attention's. No host sync.
    `prefill_tile_map` and `prefill_block_m`: `paged_prefill_attention`'s tile_map and block_m.
    """
    if max_query_len == 1:
        return decode_attention(query, key_cache, value_cache, seq_lens, block_tables, scale,
                                out=out, query_start_loc=query_start_loc, num_splits=num_splits)
    out = paged_prefill_attention(query, key_cache, value_cache, query_start_loc, seq_lens,
                                  block_tables, max_query_len, scale, out=out,
                                  skip_decode_rows=split_decode_rows, tile_map=prefill_tile_map,
                                  block_m=prefill_block_m)
    if split_decode_rows:
        decode_attention(query, key_cache, value_cache, seq_lens, block_tables, scale, out=out,
                         query_start_loc=query_start_loc, num_splits=num_splits)
    return out


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference of `paged_attention`: row by row in fp32, output in query's dtype.

    Reads index tensors on the host (.tolist()): the test oracle, not a path for the runner (that
    is flexserve.layers.attention.paged_attention_ref, which these tests also compare with).
    """
    out = torch.empty_like(query)
    return attention_rows_ref(query, key_cache, value_cache, query_start_loc.tolist(),
                              seq_lens.tolist(), block_tables, scale, out)

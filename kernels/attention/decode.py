"""Decode attention: one query token per row over its paged K/V, split-K (flash-decoding).

Grid (kv head, split, row): one program reads a contiguous range of one row's keys for one kv
head and serves all QUERIES_PER_KV query heads of that kv head at once (GQA: K/V are read once,
not once per query head). A row's keys [0, seq_len) are cut into `num_splits` equal ranges,
rounded to BLOCK_N, computed per row on the device; so the grid depends only on (rows, kv heads,
num_splits) and a CUDA graph captured with a fixed num_splits serves every context length: short
rows leave trailing splits empty. With more than one split, each writes its normalized partial
output and log-sum-exp in fp32, and a second kernel combines them in fixed order.

Layouts as flexserve.layers.attention: key_cache / value_cache [num_blocks, block_size, KV, D]
(kv_cache[0] and kv_cache[1]), position p of row b in block block_tables[b, p // block_size] at
offset p % block_size. The shared argument checks and the paged gather used by the references
live here; paged_attention.py imports them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
# A split below this many keys costs more in the reduce and in per-program overhead than it adds
# in parallelism (an estimate: 256 keys x 128 dims x 2 (K, V) x 2 bytes = 128 KiB per program).
MIN_KEYS_PER_SPLIT = 256
MAX_NUM_SPLITS = 64


@triton.jit
def _split_len(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    # Keys per split for one row, a multiple of BLOCK_N and never 0 (seq_len 0: no split active).
    per_split = (seq_len + NUM_SPLITS - 1) // NUM_SPLITS
    return tl.maximum((per_split + BLOCK_N - 1) // BLOCK_N, 1) * BLOCK_N


# stride_bt varies with the batch (see _paged_attention_kernel): not specialized.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    HAS_QUERY_START_LOC: tl.constexpr, QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    if HAS_QUERY_START_LOC:
        # Mixed batch: only rows with exactly one new token are this kernel's.
        token = tl.load(query_start_loc_ptr + row)
        if tl.load(query_start_loc_ptr + row + 1) - token != 1:
            return
    else:
        token = row
    token = token.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + row)
    chunk = _split_len(seq_len, NUM_SPLITS, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * QUERIES_PER_KV + offs_g
    gd_mask = (offs_g < QUERIES_PER_KV)[:, None] & (offs_d < HEAD_DIM)[None, :]
    out_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    if start >= end:
        # An empty split; the reduce skips it. A row without keys (padding) gets zeros.
        if NUM_SPLITS == 1:
            tl.store(out_ptrs, tl.zeros([BLOCK_G, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
                     mask=gd_mask)
        return

    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gd_mask, other=0.0)
    table_ptr = block_tables_ptr + row.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    d_mask = offs_d < HEAD_DIM
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + (block_ids * stride_kb + in_block * stride_ks)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        qk = tl.where(n_mask[None, :], qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (block_ids * stride_vb + in_block * stride_vs)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    if NUM_SPLITS == 1:
        tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        row64 = row.to(tl.int64)
        part_ptrs = (part_out_ptr + row64 * stride_pb + heads[:, None] * stride_ph + split * stride_ps
                     + offs_d[None, :])
        tl.store(part_ptrs, acc / l_i[:, None], mask=gd_mask)
        lse_ptrs = part_lse_ptr + row64 * stride_lb + heads * stride_lh + split
        tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=offs_g < QUERIES_PER_KV)


@triton.jit
def _decode_attention_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr,
    stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    HAS_QUERY_START_LOC: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Grid (head, row). Weights 2^(lse_s - max) over the row's active splits, in split order.
    head = tl.program_id(0)
    row = tl.program_id(1)
    if HAS_QUERY_START_LOC:
        token = tl.load(query_start_loc_ptr + row)
        if tl.load(query_start_loc_ptr + row + 1) - token != 1:
            return
    else:
        token = row
    token = token.to(tl.int64)
    row64 = row.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + row)
    chunk = _split_len(seq_len, NUM_SPLITS, BLOCK_N)
    num_active = (seq_len + chunk - 1) // chunk
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_active
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row64 * stride_lb + head * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))
    lse_max = tl.where(num_active > 0, tl.max(lse, 0), 0.0)  # no -inf - -inf for empty rows
    weights = tl.where(s_mask, tl.exp2(lse - lse_max), 0.0)
    parts = tl.load(part_out_ptr + row64 * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps
                    + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def check_paged_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    out: torch.Tensor | None,
) -> None:
    """Raise ValueError unless the arguments fit the paged layouts (metadata only: no host sync)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [T, num_heads, head_dim], got {tuple(query.shape)}")
    _, num_heads, head_dim = query.shape
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"key_cache and value_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {key_cache.shape[3]} != query head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not 16 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is outside [16, {MAX_HEAD_DIM}]")
    if query.dtype not in _DTYPES or key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(f"query and caches must share a dtype in {_DTYPES}, got {query.dtype}, "
                         f"{key_cache.dtype}, {value_cache.dtype}")
    num_rows = seq_lens.shape[0]
    if seq_lens.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != num_rows:
        raise ValueError(f"seq_lens must be [B] and block_tables [B, max_blocks], got "
                         f"{tuple(seq_lens.shape)} and {tuple(block_tables.shape)}")
    index_tensors = {"seq_lens": seq_lens, "block_tables": block_tables}
    if query_start_loc is not None:
        if query_start_loc.shape != (num_rows + 1,):
            raise ValueError(f"query_start_loc must be [B+1] = [{num_rows + 1}], got "
                             f"{tuple(query_start_loc.shape)}")
        index_tensors["query_start_loc"] = query_start_loc
    for name, t in index_tensors.items():
        if t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache}
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(f"out must be {query.dtype} {tuple(query.shape)}, got {out.dtype} "
                             f"{tuple(out.shape)}")
        tensors["out"] = out
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    for name, t in {**tensors, **index_tensors}.items():
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")


def decode_num_splits(
    num_rows: int, num_kv_heads: int, max_seq_len: int, device: torch.device | str
) -> int:
    """Splits per row for `decode_attention`: enough (row, kv head, split) programs for about two
    per SM, each split at least MIN_KEYS_PER_SPLIT keys of the longest row, at most 64, rounded
    down to a power of two (NUM_SPLITS is a compile-time constant: at most 7 variants compile as
    batch sizes and context lengths change).

    For a CUDA graph, call it once per captured batch size with max_seq_len = max_model_len and
    pass the result as `num_splits`: the grid then stays fixed while contexts grow.
    """
    programs = 2 * _num_sms(torch.device(device))
    wanted = triton.cdiv(programs, max(num_rows * num_kv_heads, 1))
    useful = triton.cdiv(max(max_seq_len, 1), MIN_KEYS_PER_SPLIT)
    splits = max(1, min(wanted, useful, MAX_NUM_SPLITS))
    return 1 << (splits.bit_length() - 1)


@functools.lru_cache(maxsize=None)
def _num_sms_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's CPU interpreter: a small fixed grid
    return _num_sms_of(device.index if device.index is not None else torch.cuda.current_device())


def _decode_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). 16-bit head_dim 128: 64-key tiles, three K/V stages in
    flight, 39 KiB of shared memory and 113 registers on sm_90 (offline compile, Triton 3.9), so
    several programs share an SM. head_dim 256 and fp32 (tests) halve the keys per tile."""
    block_d = triton.next_power_of_2(head_dim)
    if dtype == torch.float32:
        return 16, 4, 1
    return (64, 4, 3) if block_d <= 128 else (32, 4, 2)


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per row over the row's paged keys [0, seq_lens[b]).

    query [T, H, D]; key_cache / value_cache [num_blocks, block_size, KV, D] with H % KV == 0;
    seq_lens [B] (new token included, its K/V already in the cache); block_tables [B, max_blocks].
    Without `query_start_loc` row b's token is query[b] (T == B, a decode-only batch); with it
    ([B+1]), row b's token is query[query_start_loc[b]] and rows whose query length is not 1 are
    skipped (their `out` rows are left untouched), so a mixed batch can send its decode rows here
    without index lists. Rows with seq_len 0 (CUDA-graph padding) get zeros. Returns out [T, H, D]
    (allocated unless given). `num_splits` defaults to `decode_num_splits(B, KV, max over rows
    bounded by block_tables' width, device)`; pass it explicitly under CUDA graphs. No host sync.
    """
    check_paged_attention_args(query, key_cache, value_cache, seq_lens, block_tables,
                               query_start_loc, out)
    num_rows = seq_lens.shape[0]
    if query_start_loc is None and query.shape[0] != num_rows:
        raise ValueError(f"without query_start_loc query must have one token per row: "
                         f"{query.shape[0]} tokens, {num_rows} rows")
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if out is None:
        out = torch.empty_like(query)
    if num_rows == 0 or query.shape[0] == 0:
        return out
    default_n, default_warps, default_stages = _decode_config(head_dim, query.dtype)
    if query.device.type == "cpu":
        default_n = 64  # Triton's interpreter: its cost is per tile step, so take few large steps
    block_n = _block_arg("block_n", block_n, 16) or default_n
    if num_splits is None:
        # The table's width bounds every row's length without reading seq_lens on the host.
        num_splits = decode_num_splits(num_rows, num_kv_heads, block_tables.shape[1] * block_size,
                                       query.device)
    elif num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    queries_per_kv = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_out = torch.empty(num_rows, num_heads, num_splits, head_dim, dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32,
                               device=query.device)
    else:
        part_out = part_lse = out  # unused: the kernel writes out directly
    has_qsl = query_start_loc is not None
    qsl = query_start_loc if has_qsl else seq_lens
    part_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2),
                    part_lse.stride(0), part_lse.stride(1)) if num_splits > 1 else (0,) * 5
    _decode_attention_kernel[(num_kv_heads, num_splits, num_rows)](
        query, key_cache, value_cache, out, part_out, part_lse,
        qsl, seq_lens, block_tables,
        scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        *part_strides,
        HAS_QUERY_START_LOC=has_qsl, QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        # tl.dot needs M >= 16: groups below 16 query heads are padded (masked) to 16 rows.
        BLOCK_G=max(16, triton.next_power_of_2(queries_per_kv)), BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=num_warps or default_warps, num_stages=num_stages or default_stages,
    )
    if num_splits > 1:
        _decode_attention_reduce_kernel[(num_heads, num_rows)](
            part_out, part_lse, out, qsl, seq_lens,
            out.stride(0), out.stride(1), *part_strides,
            HAS_QUERY_START_LOC=has_qsl, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_N=block_n, BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def _block_arg(name: str, value: int | None, minimum: int) -> int | None:
    if value is not None and (value < minimum or value & (value - 1)):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")
    return value


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Positions [0, length) of one row from a paged cache [num_blocks, block_size, KV, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table.long()[pos // block_size]
    return cache[blocks, pos % block_size]


def attention_rows_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Causal paged attention row by row in fp32 (host lists: the test oracle, not a fast path).

    Row b's queries query[start_b : start_{b+1}] sit at the last positions of its seq_len keys.
    Rows with no keys get zeros; rows with no queries are skipped.
    """
    num_heads = query.shape[1]
    for b, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        if seq_len == 0:
            out[start:end] = 0
            continue
        k = gather_paged(key_cache, block_tables[b], seq_len).float()
        v = gather_paged(value_cache, block_tables[b], seq_len).float()
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[start:end].float().transpose(0, 1)  # [H, q_len, D]
        scores = q @ k.transpose(1, 2) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        visible = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[start:end] = (probs @ v).transpose(0, 1).to(out.dtype)
    return out


def decode_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference of `decode_attention` without query_start_loc: row b's token is query[b]."""
    out = torch.empty_like(query)
    num_rows = seq_lens.shape[0]
    return attention_rows_ref(query, key_cache, value_cache, list(range(num_rows + 1)),
                              seq_lens.tolist(), block_tables, scale, out)


"""Attention over one flat, unpadded token batch with a paged KV cache.

A step feeds T tokens from B rows. Row b has q_b new tokens at positions [ctx_b, ctx_b + q_b);
its keys are positions [0, seq_len_b) with seq_len_b = ctx_b + q_b, and token i of the row sees
keys [0, ctx_b + i] (causal). Chunked prefill, decode (q_b = 1) and fine-tuning windows are all
rows of this one shape.

Per layer the cache is one tensor [2, num_blocks, block_size, num_kv_heads, head_dim] (index 0 is
K, 1 is V); token position p of a row lives in flat slot
block_table[p // block_size] * block_size + p % block_size. Every layer first writes the new
tokens' K/V at `slot_mapping`, then reads each row's whole context through its block table, so a
row can read K/V that another row wrote in the same step (prefix-cache sharing relies on that).

Where `use_triton` says so (CUDA), the Triton kernels of flexserve_kernels do the work: one fused
K/V cache write, then varlen prefill attention for rows with several new tokens and split-K
decode attention for one-token rows, straight from the block tables (no padding, no gather).
`paged_attention_ref` is the plain-torch reference: the test oracle for the Triton kernels and the
path used where none is available. It pads rows to one shape per SDPA call, with decode rows and
the other rows padded separately (at most two calls per layer). All its index tensors are built
once per step in `AttentionMetadata.build` and reused by every layer: no host syncs in forward.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flexserve.layers.device_copy import to_device
from flexserve.layers.forward_context import get_forward_context
from flexserve.layers.rotary import RopeInputs
from flexserve_kernels.dispatch import use_triton


@dataclass(slots=True)
class PaddedRowGroup:
    """Rows that the reference path attends in one SDPA call, padded to one shape.

    Decode rows (q_b = 1) and the other rows form separate groups: padding a batch of long-context
    decodes to a prefill chunk's query length would cost B x max_query_len x max_seq_len.
    """

    token_index: torch.Tensor | None  # [T_g] int64: the group's tokens in the flat batch; None: all
    query_pad_index: torch.Tensor  # [T_g] int64: group token -> row_in_group * max_query_len + i
    context_slot_index: torch.Tensor  # [B_g, max_seq_len_g] int64: cache slot of key j of row b
    attn_mask: torch.Tensor  # [B_g, 1, max_query_len_g, max_seq_len_g] bool: True = query sees key


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about one step's flat batch; built once, read by all layers."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot where each new token's K/V goes
    positions: torch.Tensor  # [T] int64: position of each new token in its sequence
    query_start_loc: torch.Tensor  # [B+1] int32: row b's tokens are flat [start[b], start[b+1])
    seq_lens: torch.Tensor  # [B] int32: context + new tokens of each row
    block_tables: torch.Tensor  # [B, max_num_blocks] int32: each row's block ids, padded with 0
    max_query_len: int  # largest q_b
    max_seq_len: int  # largest seq_len_b
    block_size: int  # tokens per cache block
    row_groups: list[PaddedRowGroup]  # torch path only: 1 or 2 groups covering all rows; else []
    decode_num_splits: int | None = None  # Triton decode splits; None: chosen per launch
    # Rows with one new token (host int); None: unknown. With none, the Triton path launches the
    # prefill kernel alone, not also a decode launch with nothing to do (one launch per layer:
    # 13% of a cProfile of fine-tuning-only steps of Llama-3.1-8B, offline engine, H200).
    num_decode_rows: int | None = None
    # CUDA graphs (`MixedGraphRunner`): the prefill kernel's [2, N] (row, query tile) map, which
    # fixes its grid whatever the rows, and the tile height it was built with; None: per batch
    prefill_tile_map: torch.Tensor | None = None
    prefill_block_m: int | None = None

    @property
    def num_tokens(self) -> int:
        """T, the number of new tokens in the step."""
        return self.slot_mapping.shape[0]

    @property
    def num_rows(self) -> int:
        """B, the number of rows in the step."""
        return self.seq_lens.shape[0]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        num_computed_tokens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Metadata for rows with `query_lens[b]` new tokens after `num_computed_tokens[b]` cached.

        `block_tables[b]` is row b's whole block table; it must cover all seq_len_b positions.
        """
        num_rows = len(query_lens)
        if num_rows == 0:
            raise ValueError("a step needs at least one row")
        if len(num_computed_tokens) != num_rows or len(block_tables) != num_rows:
            raise ValueError(
                f"query_lens ({num_rows}), num_computed_tokens ({len(num_computed_tokens)}) and "
                f"block_tables ({len(block_tables)}) must have one entry per row"
            )
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        # Index math on the host in numpy int64 (per-op cost ~1 us, against ~5-10 us for a torch
        # op on tensors this small), then one host-to-device copy per dtype.
        q_lens = np.fromiter(query_lens, np.int64, num_rows)
        ctx_lens = np.fromiter(num_computed_tokens, np.int64, num_rows)
        table_lens = np.fromiter(map(len, block_tables), np.int64, num_rows)
        seq_lens = ctx_lens + q_lens
        bad = (q_lens < 1) | (ctx_lens < 0) | (table_lens * block_size < seq_lens)
        if bad.any():
            b = int(bad.argmax())
            q, ctx = int(q_lens[b]), int(ctx_lens[b])
            if q < 1 or ctx < 0:
                raise ValueError(f"row {b}: query_len {q} must be >= 1, num_computed {ctx} >= 0")
            raise ValueError(f"row {b}: {len(block_tables[b])} blocks of {block_size} cannot "
                             f"hold {ctx + q} tokens")
        max_num_blocks = int(table_lens.max())
        num_tokens = int(q_lens.sum())

        # int32 staging: [query_start_loc (B+1) | seq_lens (B) | block tables (B * M)], each
        # part starting on a 16-byte boundary: Triton specializes a kernel on whether each
        # pointer argument is 16-byte aligned, so parts at offsets that follow the batch size
        # compiled a new variant of the attention kernels for each residue of B mod 4 (H200:
        # 17 compiles, 10.3 s in all, in the first 30 s of a co-serving run).
        seq_at = _aligned_offset(num_rows + 1, 4)
        tables_at = _aligned_offset(seq_at + num_rows, 4)
        staged32 = np.zeros(tables_at + num_rows * max_num_blocks, np.int32)
        query_start_loc = staged32[:num_rows + 1]
        np.cumsum(q_lens, out=query_start_loc[1:])
        staged32[seq_at:seq_at + num_rows] = seq_lens
        tables = staged32[tables_at:].reshape(num_rows, max_num_blocks)
        flat_blocks = np.fromiter(itertools.chain.from_iterable(block_tables), np.int32)
        if int(table_lens.min()) == max_num_blocks:
            tables.reshape(-1)[:] = flat_blocks
        else:  # ragged tables: padded with block 0
            tables[np.arange(max_num_blocks) < table_lens[:, None]] = flat_blocks
        # int64 staging: [slot_mapping (T) | positions (T)], positions 16-byte aligned.
        positions_at = _aligned_offset(num_tokens, 2)
        staged64 = np.empty(positions_at + num_tokens, np.int64)
        slot_mapping, positions = staged64[:num_tokens], staged64[positions_at:]
        if num_tokens == num_rows:  # decode rows only: one token per row, at position ctx
            row_of_token = None
            positions[:] = ctx_lens
            token_tables = tables
        else:
            row_of_token = np.repeat(np.arange(num_rows), q_lens)
            positions[:] = (ctx_lens[row_of_token] + np.arange(num_tokens)
                            - query_start_loc[row_of_token])
            token_tables = tables[row_of_token]
        block_ids = np.take_along_axis(token_tables, (positions // block_size)[:, None], 1)[:, 0]
        block_ids = block_ids.astype(np.int64)
        slot_mapping[:] = block_ids * block_size + positions % block_size

        device = torch.device(device)
        row_groups: list[PaddedRowGroup] = []
        if not use_triton(device):
            host_q, host_ctx = torch.from_numpy(q_lens), torch.from_numpy(ctx_lens)
            host_tables = torch.from_numpy(tables).long()
            host_start = torch.from_numpy(query_start_loc).long()
            is_decode = host_q == 1
            groups = [is_decode.nonzero()[:, 0], (~is_decode).nonzero()[:, 0]]
            groups = [rows for rows in groups if rows.numel() > 0]
            row_groups = [
                _padded_group(rows, host_q, host_ctx, host_tables, host_start, block_size,
                              device, covers_all=len(groups) == 1)
                for rows in groups
            ]
        on_device32 = to_device(torch.from_numpy(staged32), device)
        on_device64 = to_device(torch.from_numpy(staged64), device)
        return cls(
            slot_mapping=on_device64[:num_tokens],
            positions=on_device64[positions_at:],
            query_start_loc=on_device32[:num_rows + 1],
            seq_lens=on_device32[seq_at:seq_at + num_rows],
            block_tables=on_device32[tables_at:].view(num_rows, max_num_blocks),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=block_size,
            row_groups=row_groups,
            num_decode_rows=int((q_lens == 1).sum()),
        )


def _aligned_offset(offset: int, elements: int) -> int:
    """`offset` rounded up to a multiple of `elements` (16 bytes of the staging dtype)."""
    return -(-offset // elements) * elements


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of `positions` [N, P] of rows whose block tables are `tables` [N, M]."""
    block_ids = tables.gather(-1, positions // block_size)
    return block_ids * block_size + positions % block_size


def _padded_group(
    rows: torch.Tensor,
    q_lens: torch.Tensor,
    ctx_lens: torch.Tensor,
    tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    device: torch.device,
    covers_all: bool,
) -> PaddedRowGroup:
    q_lens, ctx_lens, tables = q_lens[rows], ctx_lens[rows], tables[rows]
    seq_lens = ctx_lens + q_lens
    max_query_len, max_seq_len = int(q_lens.max()), int(seq_lens.max())
    local_row = torch.repeat_interleave(torch.arange(rows.shape[0]), q_lens)
    local_start = torch.cumsum(q_lens, 0) - q_lens
    offset = torch.arange(local_row.shape[0]) - local_start[local_row]
    token_index = query_start_loc[rows][local_row] + offset
    # Padding keys repeat the row's last real key so every gathered slot is one the row owns.
    key_pos = torch.minimum(torch.arange(max_seq_len)[None, :], seq_lens[:, None] - 1)
    # Padding queries reuse the row's last real position: no fully masked row (NaN in SDPA).
    query_pos = ctx_lens[:, None] + torch.minimum(
        torch.arange(max_query_len)[None, :], q_lens[:, None] - 1
    )
    query_pos = query_pos.to(device)
    key_idx = torch.arange(max_seq_len, device=device)
    # Built on the device: it is the one large tensor (B_g * max_query_len * max_seq_len).
    attn_mask = (key_idx[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)
    return PaddedRowGroup(
        token_index=None if covers_all else token_index.to(device),
        query_pad_index=(local_row * max_query_len + offset).to(device),
        context_slot_index=_slots(tables, key_pos, block_size).to(device),
        attn_mask=attn_mask,
    )


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [T, num_kv_heads, head_dim] into kv_cache at the flat `slot_mapping` slots;
    tokens with slot -1 (padding) are skipped, as the Triton write skips them."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    key_cache.index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    value_cache.index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_pad_index: torch.Tensor,
    context_slot_index: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of flat queries over paged context K/V, in plain torch.

    query [T, H, D]; key_cache, value_cache [num_blocks, block_size, KV, D] (H % KV == 0);
    query_pad_index, context_slot_index, attn_mask of one `PaddedRowGroup`. Returns [T, H, D].
    Rows are padded to [B, max_query_len] queries and [B, max_seq_len] keys so one SDPA call
    covers the whole batch; padding is masked (keys) or dropped (queries).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[-2]
    num_rows, _, max_query_len, _ = attn_mask.shape
    padded = query.new_zeros(num_rows * max_query_len, num_heads, head_dim)
    padded.index_copy_(0, query_pad_index, query)
    q = padded.view(num_rows, max_query_len, num_heads, head_dim).transpose(1, 2)
    # index_select on the flattened index: advanced indexing with a 2-D index was ~500x slower on
    # the 2-core CI CPU (7 ms vs 15 us gathering [300, 3, 64] by a [3, 26] index, torch 2.13).
    slots = context_slot_index.view(-1)
    kv_shape = (num_rows, context_slot_index.shape[1], num_kv_heads, head_dim)
    k = key_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, slots).view(kv_shape)
    v = value_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, slots).view(kv_shape)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=attn_mask, scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    out = out.transpose(1, 2).reshape(num_rows * max_query_len, num_heads, head_dim)
    return out.index_select(0, query_pad_index)


class Attention(nn.Module):
    """Paged causal attention of one layer; the runner binds `kv_cache` before the first forward."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # A plain attribute, not a buffer: the cache is owned by the runner, is not a weight and
        # must not move with model.to() or appear in state_dict().
        self.kv_cache: torch.Tensor | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                rope: RopeInputs | None = None) -> torch.Tensor:
        """query [T, H*D], key/value [T, KV*D] -> [T, H*D]; metadata from the forward context.
        With `rope`, q and k are rotated here first (fused with the KV-cache write on the Triton
        path); without it they arrive rotated."""
        if self.kv_cache is None:
            raise RuntimeError("no KV cache is bound to this layer; call model.bind_kv_caches()")
        metadata: AttentionMetadata = get_forward_context().attn_metadata
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_dim)
        k = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = self.kv_cache[0], self.kv_cache[1]
        if use_triton(q.device):
            from flexserve_kernels.attention.paged import paged_attention

            if rope is not None:
                from flexserve_kernels.norm_rope.rope_kv_write import rope_kv_write

                rope_kv_write(rope.positions, q, k, v, rope.cos_sin_cache, self.kv_cache,
                              metadata.slot_mapping, self.head_dim)
            else:
                from flexserve_kernels.attention.kv_cache_write import kv_cache_write

                kv_cache_write(k, v, self.kv_cache, metadata.slot_mapping)
            out = paged_attention(
                q, key_cache, value_cache, metadata.query_start_loc, metadata.seq_lens,
                metadata.block_tables, metadata.max_query_len, self.scale,
                num_splits=metadata.decode_num_splits,
                split_decode_rows=metadata.num_decode_rows != 0,
                prefill_tile_map=metadata.prefill_tile_map,
                prefill_block_m=metadata.prefill_block_m,
            )
            return out.reshape(num_tokens, self.num_heads * self.head_dim)
        if rope is not None:
            q, k = (t.view(num_tokens, -1, self.head_dim) for t in rope.apply(q, k))
        write_kv_cache(k, v, self.kv_cache, metadata.slot_mapping)
        groups = metadata.row_groups
        if len(groups) == 1 and groups[0].token_index is None:
            g = groups[0]
            out = paged_attention_ref(q, key_cache, value_cache, g.query_pad_index,
                                      g.context_slot_index, g.attn_mask, self.scale)
        else:
            out = torch.empty_like(q)
            for g in groups:
                part = paged_attention_ref(
                    q.index_select(0, g.token_index), key_cache, value_cache, g.query_pad_index,
                    g.context_slot_index, g.attn_mask, self.scale,
                )
                out.index_copy_(0, g.token_index, part)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"num_kv_heads={self.num_kv_heads}, scale={self.scale:.4g}"
        )

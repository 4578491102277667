"""Paged attention reference vs naive per-sequence causal attention; metadata; forward context."""

from __future__ import annotations

import math

import pytest
import torch

from flexserve.layers.attention import Attention, AttentionMetadata
from flexserve.layers.forward_context import get_forward_context, set_forward_context


def naive_attention(q, k_all, v_all, ctx, scale):
    """q [q_len, H, D] at positions ctx..; k_all/v_all [seq_len, KV, D]; plain causal softmax."""
    num_heads, num_kv_heads = q.shape[1], k_all.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        visible = ctx + i + 1
        for h in range(num_heads):
            keys = k_all[:visible, h // group].double()
            scores = keys @ q[i, h].double() * scale
            out[i, h] = (torch.softmax(scores, 0) @ v_all[:visible, h // group].double()).to(q.dtype)
    return out


def run_case(
    rows, block_size, num_heads, num_kv_heads, head_dim, seed=0, dtype=torch.float32, device="cpu"
):
    """rows: (num_computed, query_len, shares_prefix_of) triples. Returns (got, expected) on CPU."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + q for ctx, q, _ in rows]
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    # Garbage in the cache: reading any slot that was not written shows up as a mismatch.
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    tables, histories, new_q, new_k, new_v = [], [], [], [], []
    for b, (ctx, q_len, owner) in enumerate(rows):
        if owner is None:
            table = [perm.pop() for _ in range(blocks_needed[b])]
            k_ctx = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
            v_ctx = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
            for p in range(ctx):  # context written by an earlier step
                block, off = table[p // block_size], p % block_size
                kv_cache[0, block, off], kv_cache[1, block, off] = k_ctx[p], v_ctx[p]
        else:
            # Reads the blocks that row `owner` writes in this very call (prefix sharing).
            assert ctx % block_size == 0 and ctx <= rows[owner][0] + rows[owner][1]
            shared = tables[owner][: ctx // block_size]
            table = shared + [perm.pop() for _ in range(blocks_needed[b] - len(shared))]
            k_ctx, v_ctx = histories[owner][0][:ctx], histories[owner][1][:ctx]
        k = torch.randn(q_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(q_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        new_q.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
        new_k.append(k)
        new_v.append(v)
        tables.append(table)
        histories.append((torch.cat([k_ctx, k]), torch.cat([v_ctx, v])))

    metadata = AttentionMetadata.build(
        [q for _, q, _ in rows], [ctx for ctx, _, _ in rows], tables, block_size, device
    )
    scale = head_dim**-0.5
    attn = Attention(num_heads, head_dim, num_kv_heads, scale)
    attn.kv_cache = kv_cache.to(device)
    num_tokens = metadata.num_tokens
    with set_forward_context(metadata):
        got = attn(
            torch.cat(new_q).reshape(num_tokens, -1).to(device),
            torch.cat(new_k).reshape(num_tokens, -1).to(device),
            torch.cat(new_v).reshape(num_tokens, -1).to(device),
        ).view(num_tokens, num_heads, head_dim).cpu()
    expected = torch.cat([
        naive_attention(new_q[b], histories[b][0], histories[b][1], rows[b][0], scale)
        for b in range(len(rows))
    ])
    return got, expected


MIXED_ROWS = [
    (0, 7, None),  # first prefill chunk
    (5, 1, None),  # decode
    (11, 6, None),  # later prefill chunk
    (20, 1, None),  # decode with a long context
    (0, 1, None),  # single-token prompt
]


@pytest.mark.parametrize("block_size", [1, 3, 5, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_matches_naive_attention(block_size, num_heads, num_kv_heads):
    got, expected = run_case(MIXED_ROWS, block_size, num_heads, num_kv_heads, head_dim=16)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [
    [(3, 1, None), (0, 1, None), (17, 1, None)],  # decode rows only: one group
    [(0, 4, None), (6, 9, None), (2, 2, None)],  # prefill rows only: one group
])
def test_single_group_batches(rows):
    got, expected = run_case(rows, 4, 4, 2, head_dim=16, seed=5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [2, 4])
def test_row_reads_kv_written_by_another_row_in_the_same_call(block_size):
    rows = [(0, 9, None), (8, 3, 0), (2, 4, None), (4, 1, 0)]
    got, expected = run_case(rows, block_size, 4, 2, head_dim=8, seed=3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_fp64_reference():
    got, expected = run_case(MIXED_ROWS, 4, 8, 2, head_dim=32, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_naive_attention_on_cuda(dtype, tol):
    # TF32 is off by default for SDPA/matmul in fp32, so fp32 keeps the CPU tolerance.
    for rows in (MIXED_ROWS, [(0, 9, None), (8, 3, 0), (2, 4, None), (4, 1, 0)]):
        got, expected = run_case(rows, 4, 8, 2, head_dim=64, dtype=dtype, device="cuda")
        torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_metadata_build_by_hand():
    md = AttentionMetadata.build([3, 1], [0, 5], [[7, 2], [4, 9]], block_size=4, device="cpu")
    assert md.positions.tolist() == [0, 1, 2, 5]
    assert md.slot_mapping.tolist() == [28, 29, 30, 9 * 4 + 1]
    assert md.query_start_loc.tolist() == [0, 3, 4]
    assert md.query_start_loc.dtype == torch.int32
    assert md.seq_lens.tolist() == [3, 6]
    assert md.block_tables.tolist() == [[7, 2], [4, 9]]
    assert (md.max_query_len, md.max_seq_len, md.num_tokens, md.num_rows) == (3, 6, 4, 2)
    decode, prefill = md.row_groups
    assert decode.token_index.tolist() == [3]
    assert decode.query_pad_index.tolist() == [0]
    assert decode.context_slot_index.tolist() == [[16, 17, 18, 19, 36, 37]]
    assert decode.attn_mask.shape == (1, 1, 1, 6) and decode.attn_mask.all()
    assert prefill.token_index.tolist() == [0, 1, 2]
    assert prefill.query_pad_index.tolist() == [0, 1, 2]
    assert prefill.context_slot_index.tolist() == [[28, 29, 30]]
    assert prefill.attn_mask[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize("num_rows", range(1, 10))
def test_metadata_parts_start_16_byte_aligned(num_rows):
    # Triton specializes on the 16-byte alignment of each pointer: every part of the staged
    # metadata starts aligned whatever B and T are, so batch shapes do not compile variants.
    query_lens = [1 + (3 * b) % 5 for b in range(num_rows)]
    md = AttentionMetadata.build(query_lens, [b for b in range(num_rows)],
                                 [[b, b + 1] for b in range(num_rows)], block_size=8,
                                 device="cpu")
    base32, base64 = md.query_start_loc.data_ptr(), md.slot_mapping.data_ptr()
    assert (md.seq_lens.data_ptr() - base32) % 16 == 0
    assert (md.block_tables.data_ptr() - base32) % 16 == 0
    assert (md.positions.data_ptr() - base64) % 16 == 0
    assert md.seq_lens.tolist() == [q + b for b, q in enumerate(query_lens)]
    assert md.block_tables.tolist() == [[b, b + 1] for b in range(num_rows)]
    assert md.positions.tolist() == [b + i for b, q in enumerate(query_lens) for i in range(q)]
    assert md.num_decode_rows == query_lens.count(1)


def test_metadata_single_group_pads_rows():
    md = AttentionMetadata.build([2, 4], [1, 0], [[5], [6, 3]], block_size=3, device="cpu")
    (group,) = md.row_groups
    assert group.token_index is None
    assert group.query_pad_index.tolist() == [0, 1, 4, 5, 6, 7]
    # Row 0 pads its keys 3 with its last real key (position 2, slot 17).
    assert group.context_slot_index.tolist() == [[15, 16, 17, 17], [18, 19, 20, 9]]
    # Row 0's padding queries reuse its last real position (2).
    assert group.attn_mask[0, 0].int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0],
                                                    [1, 1, 1, 0]]


@pytest.mark.parametrize(
    "query_lens,computed,tables,match",
    [
        ([], [], [], "at least one row"),
        ([2, 1], [0], [[0], [1]], "one entry per row"),
        ([0], [0], [[0]], "query_len 0"),
        ([1], [-1], [[0]], "num_computed -1"),
        ([3], [6], [[0, 1]], "cannot hold 9 tokens"),
    ],
)
def test_metadata_rejects_bad_rows(query_lens, computed, tables, match):
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build(query_lens, computed, tables, 4, "cpu")


def test_attention_rejects_bad_head_counts_and_unbound_cache():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        Attention(6, 8, 4, 1.0)
    attn = Attention(2, 4, 1, 0.5)
    md = AttentionMetadata.build([1], [0], [[0]], 4, "cpu")
    with set_forward_context(md), pytest.raises(RuntimeError, match="bind_kv_caches"):
        attn(torch.zeros(1, 8), torch.zeros(1, 4), torch.zeros(1, 4))


def test_forward_context_nests_and_restores():
    with pytest.raises(RuntimeError, match="set_forward_context"):
        get_forward_context()
    with set_forward_context("outer", lora_meta="outer-lora"):
        assert get_forward_context().attn_metadata == "outer"
        assert get_forward_context().lora_meta == "outer-lora"
        with set_forward_context("inner"):
            assert get_forward_context().attn_metadata == "inner"
            assert get_forward_context().lora_meta is None
        assert get_forward_context().attn_metadata == "outer"
        with pytest.raises(KeyError), set_forward_context("failing"):
            raise KeyError("boom")
        assert get_forward_context().lora_meta == "outer-lora"
    with pytest.raises(RuntimeError):
        get_forward_context()

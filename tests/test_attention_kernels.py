"""Paged prefill/decode attention and the KV-cache write kernels vs their torch references.

Without CUDA the kernels run on CPU under Triton's interpreter. Triton (3.9) reads
TRITON_INTERPRET when it decorates a jit function, its own library's included (decorated when
triton is first imported), and again at a kernel's first launch. So this module sets it around
importing the kernels and, through an autouse fixture, around each test; it never leaves it set
for other modules. When another module imported Triton first without it (under a plain `pytest`
over tests/, transformers' import does), the whole module reruns in a child process with
TRITON_INTERPRET=1. With CUDA the same cases run compiled, plus bf16 and the Llama-3.1-8B shapes.

Every cache slot that no row owns, and each block table's padding, holds NaN, and outputs start
as NaN: a read outside a row's keys, or a token left unwritten, fails the comparison.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from _triton_interpret import (
    import_kernels,
    interpreter_hooks,
    is_interpreted,
    library_is_compiled,
)

_KERNEL_MODULES = (
    "flexserve_kernels.attention.decode",  # before paged_attention, which imports from it
    "flexserve_kernels.attention.paged",
    "flexserve_kernels.attention.kv_cache_write",
)


decode_mod, paged_mod, kv_mod = import_kernels(_KERNEL_MODULES, interpret=not torch.cuda.is_available())

import triton  # noqa: E402

from flexserve.layers.attention import Attention, AttentionMetadata, write_kv_cache  # noqa: E402
from flexserve.layers.forward_context import set_forward_context  # noqa: E402

INTERPRETED = is_interpreted(decode_mod._decode_attention_kernel)
DEVICE = "cpu" if INTERPRETED else "cuda"
# Triton's own library was decorated without the interpreter: it cannot run interpreted here.
RUN_IN_CHILD = INTERPRETED and library_is_compiled()
# The interpreter's tl.dot multiplies bfloat16 bit patterns (triton-lang/triton#11584): bf16
# attention is checked on the GPU only; fp16 is the interpreter's 16-bit case.
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# (atol, rtol) vs the fp32 reference on the same inputs (q/k/v unit variance; outputs O(0.1-1)).
# fp32: only summation order and exp2 differ (interpreter: 7e-7 seen). 16-bit: P is rounded to
# the input dtype for the P@V dot and the output once (interpreter fp16: 1.2e-3 max seen, half an
# fp16 ulp at 2; bf16, 8x coarser, emulated in torch: 1.1e-3 max, 2.3e-3 relative L2).
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 5e-3), torch.bfloat16: (1.5e-2, 2e-2)}


test_module_in_interpreter_child_process, _triton_interpret = interpreter_hooks(
    __file__, INTERPRETED, RUN_IN_CHILD)


# ------------------------------------------------------------------------------------ batches


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, KV, D]; NaN outside the rows' keys
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with an all-NaN block
    max_query_len: int
    scale: float
    tables: list[list[int]]  # each row's own block ids, unpadded

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.query_start_loc, self.seq_lens,
                self.block_tables)

    def reference(self) -> torch.Tensor:
        """fp32 attention on these (possibly 16-bit) inputs."""
        return paged_mod.paged_attention_ref(self.query.float(), self.key_cache.float(),
                                             self.value_cache.float(), *self.args()[3:], self.scale)


def make_batch(rows, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
               device=DEVICE, seed=0) -> Batch:
    """rows: (context_len, query_len) per row; all keys (context and new) already in the cache.

    Block ids come from a shuffled pool: each row's blocks are scattered and out of order.
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + q for ctx, q in rows]
    needed = [triton.cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(needed) + 2
    pool = torch.randperm(num_blocks, generator=g).tolist()
    poison_block = pool.pop()
    tables = [[pool.pop() for _ in range(n)] for n in needed]
    width = max(needed) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"))
    value_cache = torch.full(shape, float("nan"))
    for table, seq_len in zip(tables, seq_lens):
        pos = torch.arange(seq_len)
        blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
        key_cache[blocks, pos % block_size] = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
        value_cache[blocks, pos % block_size] = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
    q_lens = torch.tensor([q for _, q in rows])
    query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    query = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=g)
    block_tables = torch.tensor([t + [poison_block] * (width - len(t)) for t in tables], dtype=torch.int32)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return Batch(to(query), to(key_cache), to(value_cache), query_start_loc.to(device),
                 torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables.to(device),
                 int(q_lens.max()), head_dim**-0.5, tables)


def assert_attention_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and not torch.isnan(out).any()
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


# name: (rows as (context_len, query_len), num_heads, num_kv_heads, head_dim, block_size)
PREFILL_CASES = {
    # Fresh prompts (no context) of odd lengths, GQA 3.
    "ctx0-gqa3-bs16": ([(0, 37), (0, 16), (0, 5), (0, 50)], 6, 2, 64, 16),
    # Chunked prefill: context and several new tokens per row, GQA 4, 8-token blocks.
    "chunked-gqa4-bs8": ([(45, 19), (16, 17), (3, 40), (100, 2)], 8, 2, 64, 8),
    # Prefill chunks mixed with decode rows, GQA 8, head_dim 128.
    "mixed-gqa8-d128-bs16": ([(0, 23), (77, 1), (31, 33), (150, 1), (0, 1), (16, 16)], 8, 1, 128, 16),
    # MHA (GQA 1), head_dim 80 (padded to 128 in the kernel), 32-token blocks.
    "mha-d80-bs32": ([(10, 21), (64, 1), (0, 50), (33, 3)], 2, 2, 80, 32),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case_id", sorted(PREFILL_CASES))
def test_paged_attention_matches_reference(case_id, dtype):
    batch = make_batch(*PREFILL_CASES[case_id], dtype=dtype)
    expected = batch.reference()
    out = torch.full_like(batch.query, float("nan"))
    got = paged_mod.paged_attention(*batch.args(), batch.max_query_len, batch.scale, out=out)
    assert got is out
    assert_attention_close(out, expected, dtype)


@pytest.mark.parametrize("case_id", sorted(PREFILL_CASES))
def test_prefill_kernel_alone_with_small_tiles(case_id):
    # 16 x 16 tiles: every row crosses several query tiles, full key tiles and diagonal tiles;
    # the prefill kernel also takes the one-token rows here.
    batch = make_batch(*PREFILL_CASES[case_id], seed=1)
    out = torch.full_like(batch.query, float("nan"))
    paged_mod.paged_prefill_attention(*batch.args(), batch.max_query_len, batch.scale, out=out,
                                      block_m=16, block_n=16)
    assert_attention_close(out, batch.reference(), torch.float32)


def test_mixed_batch_kernels_write_only_their_rows():
    batch = make_batch(*PREFILL_CASES["mixed-gqa8-d128-bs16"], seed=2)
    expected = batch.reference()
    q_lens = batch.query_start_loc.diff().cpu()
    decode_tokens = batch.query_start_loc[:-1].cpu()[q_lens == 1].long()
    is_decode = torch.zeros(batch.query.shape[0], dtype=torch.bool)
    is_decode[decode_tokens] = True

    out = torch.full_like(batch.query, float("nan"))
    paged_mod.paged_prefill_attention(*batch.args(), batch.max_query_len, batch.scale, out=out,
                                      skip_decode_rows=True)
    assert torch.isnan(out.cpu()[is_decode]).all()
    assert_attention_close(out[~is_decode.to(out.device)], expected[~is_decode], torch.float32)

    out = torch.full_like(batch.query, float("nan"))
    decode_mod.decode_attention(*batch.args()[:3], batch.seq_lens, batch.block_tables, batch.scale,
                                out=out, query_start_loc=batch.query_start_loc, num_splits=3)
    assert torch.isnan(out.cpu()[~is_decode]).all()
    assert_attention_close(out[is_decode.to(out.device)], expected[is_decode], torch.float32)

    out = torch.full_like(batch.query, float("nan"))
    paged_mod.paged_attention(*batch.args(), batch.max_query_len, batch.scale, out=out,
                              split_decode_rows=False)
    assert_attention_close(out, expected, torch.float32)


@pytest.mark.parametrize("case_id", sorted(PREFILL_CASES))
def test_tile_map_grid_with_padding_rows(case_id):
    # The CUDA-graph form: rows padded with empty ones (query length 0, seq_len 0) and a tile map
    # of fixed length, longer than the tiles, covering the rows with several tokens; one-token
    # rows go to the decode kernel. Every real token must be written and match the reference.
    from flexserve_kernels.lora.serve.meta import segment_tile_map

    batch = make_batch(*PREFILL_CASES[case_id], seed=4)
    expected = batch.reference()
    num_rows = batch.seq_lens.shape[0]
    pad_rows = 3
    start = torch.cat([batch.query_start_loc,
                       batch.query_start_loc[-1:].repeat(pad_rows)])
    seq_lens = torch.cat([batch.seq_lens, batch.seq_lens.new_zeros(pad_rows)])
    tables = torch.cat([batch.block_tables, batch.block_tables[:1].repeat(pad_rows, 1)])
    q_lens = start.diff().cpu().numpy()
    block_m = 16
    tile_map = torch.from_numpy(segment_tile_map(
        (q_lens > 1) * q_lens, block_m, 64, last_tile_first=True)).to(DEVICE)
    out = torch.full_like(batch.query, float("nan"))
    paged_mod.paged_attention(batch.query, batch.key_cache, batch.value_cache, start, seq_lens,
                              tables, 2 * batch.max_query_len, batch.scale, out=out,
                              num_splits=2, prefill_tile_map=tile_map, prefill_block_m=block_m)
    assert num_rows + pad_rows == seq_lens.shape[0]
    assert_attention_close(out, expected, torch.float32)


def test_reference_matches_the_layer_torch_path():
    # The oracle agrees with flexserve.layers.attention (its own test checks it against naive
    # attention), and the kernels drop into Attention.forward on AttentionMetadata's fields.
    batch = make_batch(*PREFILL_CASES["chunked-gqa4-bs8"], seed=3)
    rows = PREFILL_CASES["chunked-gqa4-bs8"][0]
    md = AttentionMetadata.build([q for _, q in rows], [c for c, _ in rows], batch.tables, 8, DEVICE)
    attn = Attention(8, 64, 2, batch.scale)
    kv_cache = torch.stack([batch.key_cache, batch.value_cache]).nan_to_num()
    slot_k = kv_cache[0].view(-1, 2, 64)[md.slot_mapping].clone()
    slot_v = kv_cache[1].view(-1, 2, 64)[md.slot_mapping].clone()
    attn.kv_cache = kv_cache.clone()
    with set_forward_context(md):
        expected = attn(batch.query.reshape(md.num_tokens, -1), slot_k.reshape(md.num_tokens, -1),
                        slot_v.reshape(md.num_tokens, -1)).view_as(batch.query)
    ours = kv_cache.clone()
    kv_mod.kv_cache_write(slot_k, slot_v, ours, md.slot_mapping)
    got = paged_mod.paged_attention(batch.query, ours[0], ours[1], md.query_start_loc, md.seq_lens,
                                    md.block_tables, md.max_query_len, batch.scale)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    ref = paged_mod.paged_attention_ref(batch.query, ours[0], ours[1], md.query_start_loc,
                                        md.seq_lens, md.block_tables, batch.scale)
    torch.testing.assert_close(ref, expected, atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------- decode

# Decode rows: a one-key row, exactly one block, one key into the next, long rows that cross
# split and tile boundaries (with 8 splits of 16-key tiles: 300 keys -> 7 splits of 48, the
# last partial and the 8th empty).
DECODE_SEQ_LENS = (1, 16, 17, 255, 300)
GQA = {"gqa1": (2, 2), "gqa3": (3, 1), "gqa4": (8, 2), "gqa8": (8, 1)}


@pytest.mark.parametrize("num_splits", [1, 8])
@pytest.mark.parametrize("gqa", sorted(GQA))
def test_decode_matches_reference(gqa, num_splits):
    num_heads, num_kv_heads = GQA[gqa]
    batch = make_batch([(n - 1, 1) for n in DECODE_SEQ_LENS], num_heads, num_kv_heads, 64, 16,
                       seed=num_splits)
    out = torch.full_like(batch.query, float("nan"))
    got = decode_mod.decode_attention(batch.query, batch.key_cache, batch.value_cache, batch.seq_lens,
                                      batch.block_tables, batch.scale, out=out, num_splits=num_splits,
                                      block_n=16)
    assert got is out
    assert_attention_close(out, batch.reference(), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_decode_head_dim_128_block_size_8_default_config(dtype):
    rows = [(n - 1, 1) for n in (3, 8, 9, 200, 333, 41)]
    batch = make_batch(rows, 12, 3, 128, 8, dtype=dtype, seed=4)
    expected = batch.reference()
    for num_splits in (None, 5):
        out = torch.full_like(batch.query, float("nan"))
        decode_mod.decode_attention(batch.query, batch.key_cache, batch.value_cache, batch.seq_lens,
                                    batch.block_tables, batch.scale, out=out, num_splits=num_splits)
        assert_attention_close(out, expected, dtype)


def test_decode_rows_without_keys_get_zeros():
    # CUDA-graph padding rows (seq_len 0) must not produce NaN that could leak into o_proj.
    batch = make_batch([(40, 1), (0, 1), (6, 1)], 4, 2, 64, 16, seed=5)
    batch.seq_lens[1] = 0
    expected = batch.reference()
    assert expected[1].eq(0).all()
    for num_splits in (1, 4):
        out = torch.full_like(batch.query, float("nan"))
        decode_mod.decode_attention(batch.query, batch.key_cache, batch.value_cache, batch.seq_lens,
                                    batch.block_tables, batch.scale, out=out, num_splits=num_splits)
        assert_attention_close(out, expected, torch.float32)


def test_decode_num_splits_heuristic():
    split = decode_mod.decode_num_splits
    # The CPU stands in for 4 SMs: 8 programs wanted.
    assert split(1, 1, 10_000, "cpu") == 8
    assert split(1, 1, 300, "cpu") == 2  # at least MIN_KEYS_PER_SPLIT (256) keys per split
    assert split(64, 8, 8192, "cpu") == 1
    assert split(1, 1, 0, "cpu") == 1
    assert split(1, 3, 10_000, "cpu") == 2  # 3 programs per split: 8 / 3 -> 3, rounded to 2


# ----------------------------------------------------------------------------- KV cache write


@pytest.mark.parametrize("key_dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16),
])
@pytest.mark.parametrize("block_size", [16, 8])
def test_kv_cache_write_matches_reference(key_dtype, cache_dtype, block_size):
    g = torch.Generator().manual_seed(block_size)
    num_tokens, num_heads, num_kv_heads, head_dim, num_blocks = 13, 6, 3, 80, 5
    # k and v are column slices of a fused qkv projection output: strided rows.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    qkv = qkv.to(device=DEVICE, dtype=key_dtype)
    key = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    slots = slots.to(DEVICE)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                       dtype=cache_dtype, device=DEVICE)
    expected = cache.clone()
    kv_mod.kv_cache_write_ref(key, value, expected, slots)
    kv_mod.kv_cache_write(key, value, cache, slots)
    assert torch.equal(cache.isnan(), expected.isnan())
    assert torch.equal(cache.nan_to_num(), expected.nan_to_num())
    # Without padding the reference is the layer's write_kv_cache.
    keep = slots >= 0
    layer = torch.full_like(cache, float("nan"))
    write_kv_cache(key[keep], value[keep], layer, slots[keep])
    assert torch.equal(layer.nan_to_num(), expected.nan_to_num())


# ------------------------------------------------------------------------- GPU compilation


def test_kernels_compile_for_sm90_without_register_spills():
    # What the interpreter cannot show: every kernel at its Llama-3.1-8B bf16 configuration
    # compiles for sm_90 (Triton's bundled ptxas, no GPU needed) and keeps within registers.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia")):
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "benchmarks/attention_kernels.py", "--compile-check"],
                            cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "prefill d128" in result.stdout and "decode d128" in result.stdout


# -------------------------------------------------------------------------------- bad inputs


def _bad_attention_inputs():
    b = make_batch([(3, 2), (5, 1)], 4, 2, 64, 16)
    return {
        "query rank": (dict(query=b.query[0]), "query must be"),
        "head count": (dict(query=b.query[:, :3]), "multiple of num_kv_heads"),
        "head dim": (dict(query=b.query[..., :32]), "head_dim"),
        "cache shape": (dict(value_cache=b.value_cache[:-1]), "key_cache and value_cache"),
        "dtype": (dict(key_cache=b.key_cache.double()), "share a dtype"),
        "strided query": (dict(query=b.query.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
        "seq_lens dtype": (dict(seq_lens=b.seq_lens.float()), "int32 or int64"),
        "query_start_loc size": (dict(query_start_loc=b.query_start_loc[:-1]), r"\[B\+1\]"),
        "block_tables rows": (dict(block_tables=b.block_tables[:1]), "block_tables"),
        "max_query_len": (dict(max_query_len=0), "max_query_len"),
    }, dict(query=b.query, key_cache=b.key_cache, value_cache=b.value_cache,
            query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, block_tables=b.block_tables,
            max_query_len=2, scale=b.scale)


@pytest.mark.parametrize("which", sorted(_bad_attention_inputs()[0]))
def test_prefill_rejects_bad_inputs(which):
    bad, args = _bad_attention_inputs()
    override, message = bad[which]
    with pytest.raises(ValueError, match=message):
        paged_mod.paged_prefill_attention(**{**args, **override})


def test_decode_and_cache_write_reject_bad_inputs():
    b = make_batch([(3, 1), (5, 1)], 4, 2, 64, 16)
    args = (b.query, b.key_cache, b.value_cache, b.seq_lens, b.block_tables, b.scale)
    with pytest.raises(ValueError, match="one token per row"):
        decode_mod.decode_attention(b.query[:1], *args[1:])
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        decode_mod.decode_attention(*args, num_splits=0)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        decode_mod.decode_attention(*args, block_n=24)
    with pytest.raises(ValueError, match="out must be"):
        decode_mod.decode_attention(*args, out=b.query.half())
    key = torch.zeros(2, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 3, 16, 2, 64, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="kv_cache"):
        kv_mod.kv_cache_write(key, key, cache[:, :, :, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_mod.kv_cache_write(key, key, cache, slots.float())
    with pytest.raises(ValueError, match="key and value"):
        kv_mod.kv_cache_write(key, key[:1], cache, slots)


# ------------------------------------------------------------------- GPU: Llama-3.1-8B shapes

# 32 query heads, 8 kv heads, head_dim 128, 16-token blocks, bf16. The reference is fp32 on the
# same bf16 inputs. Tolerance: relative L2 error < 1e-2 and max abs error < 2e-2 (torch emulation
# of the kernel's bf16 roundings of P and the output: 2.3e-3 relative L2, 1.1e-3 max).
LLAMA = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def _check_llama(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert not torch.isnan(out).any()
    assert rel_l2(out, expected) < 1e-2
    assert (out.float() - expected.float()).abs().max().item() < 2e-2


LLAMA_PREFILL = {
    "prefill-4096": [(0, 4096)],
    "chunked-2048+2048": [(2048, 2048)],
    # A scheduler-style mixed step: two chunks and 30 decode rows of 512..8192 keys.
    "mixed-chunks-and-decodes": [(1000, 1024), (0, 997)] + [(511 + 255 * i, 1) for i in range(30)],
}


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="Llama-sized shapes only compiled on a GPU")
@pytest.mark.parametrize("case_id", sorted(LLAMA_PREFILL))
def test_llama8b_prefill_bf16(case_id):
    rows = LLAMA_PREFILL[case_id]
    shape = (LLAMA["num_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"], LLAMA["block_size"])
    batch = make_batch(rows, *shape, dtype=torch.bfloat16, seed=7)
    expected = batch.reference()
    out = paged_mod.paged_attention(*batch.args(), batch.max_query_len, batch.scale)
    _check_llama(out, expected)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="Llama-sized shapes only compiled on a GPU")
@pytest.mark.parametrize("batch_size", [1, 32, 64])
def test_llama8b_decode_bf16(batch_size):
    # Contexts spread over 512..8192 (odd lengths: every last block partly filled).
    lens = [8191] if batch_size == 1 else [511 + (8192 - 512) * i // (batch_size - 1) for i in range(batch_size)]
    shape = (LLAMA["num_heads"], LLAMA["num_kv_heads"], LLAMA["head_dim"], LLAMA["block_size"])
    batch = make_batch([(n - 1, 1) for n in lens], *shape, dtype=torch.bfloat16, seed=batch_size)
    expected = batch.reference()
    graph_splits = decode_mod.decode_num_splits(batch_size, LLAMA["num_kv_heads"], 8192, "cuda")
    for num_splits in (None, 1, graph_splits):
        out = decode_mod.decode_attention(batch.query, batch.key_cache, batch.value_cache,
                                          batch.seq_lens, batch.block_tables, batch.scale,
                                          num_splits=num_splits)
        _check_llama(out, expected)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs")
def test_cache_write_and_decode_replay_in_a_cuda_graph():
    # Captured once with a fixed num_splits, replayed after the step's tensors change in place:
    # longer contexts, other block tables, new tokens. No host sync may happen inside.
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    batch_size, max_blocks, num_blocks = 8, 64, 8 * 64 + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device="cuda",
                           dtype=torch.bfloat16, generator=g)
    query = torch.empty(batch_size, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    key = torch.empty(batch_size, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    value = torch.empty_like(key)
    seq_lens = torch.empty(batch_size, dtype=torch.int32, device="cuda")
    block_tables = torch.empty(batch_size, max_blocks, dtype=torch.int32, device="cuda")
    slot_mapping = torch.empty(batch_size, dtype=torch.int64, device="cuda")
    out = torch.empty_like(query)
    num_splits = decode_mod.decode_num_splits(batch_size, num_kv_heads, max_blocks * block_size, "cuda")

    def fill(step: int) -> None:
        perm = torch.randperm(num_blocks - 1, device="cuda", generator=g)[: batch_size * max_blocks] + 1
        block_tables.copy_(perm.view(batch_size, max_blocks).int())
        lens = torch.randint(1, max_blocks * block_size, (batch_size,), device="cuda", generator=g)
        lens[0] = 1 + step  # a short row next to long ones
        seq_lens.copy_(lens.int())
        last = (lens - 1).long()
        slot_mapping.copy_(block_tables.long().gather(1, (last // block_size)[:, None])[:, 0] * block_size
                           + last % block_size)
        for t in (query, key, value):
            t.copy_(torch.randn(t.shape, device="cuda", generator=g))

    def step() -> None:
        kv_mod.kv_cache_write(key, value, kv_cache, slot_mapping)
        decode_mod.decode_attention(query, kv_cache[0], kv_cache[1], seq_lens, block_tables, 128**-0.5,
                                    out=out, num_splits=num_splits)

    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(3):
        fill(i + 1)
        expected_cache = kv_cache.clone()
        kv_mod.kv_cache_write_ref(key, value, expected_cache, slot_mapping)
        expected = decode_mod.decode_attention_ref(query.float(), expected_cache[0].float(),
                                                   expected_cache[1].float(), seq_lens, block_tables,
                                                   128**-0.5)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kv_cache, expected_cache)
        _check_llama(out, expected)

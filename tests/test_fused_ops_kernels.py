"""RMSNorm + residual add, rotary embedding (alone and fused with the KV-cache write) and
SiLU-and-mul kernels vs their torch references.

The references are checked against flexserve's eager layers (RMSNorm, RotaryEmbedding, LlamaMLP's
silu-mul) bitwise, so "kernel matches reference" means "kernel matches the eager model path".
Without CUDA the kernels run under Triton's interpreter, set up as in test_attention_kernels.py
(see its docstring): around the import, around each test, or in a child process when Triton was
imported first without it.

Tolerances: the kernels round at the same points as the eager ops, so the differences left are
fp32 summation order (RMSNorm's mean of squares) and exp/rsqrt implementations, one ulp at most:
rotary is bitwise in 16-bit on the GPU. Triton's interpreter converts fp32 to bf16 by truncating
instead of rounding to nearest (numpy has no bf16), so interpreted bf16 allows a few ulps.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _triton_interpret import (
    import_kernels,
    interpreter_hooks,
    is_interpreted,
    library_is_compiled,
)

_KERNEL_MODULES = (
    "flexserve_kernels.norm_rope.rmsnorm",
    "flexserve_kernels.norm_rope.rotary",
    "flexserve_kernels.activation",
    "flexserve_kernels.attention.kv_cache_write",
    "flexserve_kernels.norm_rope.rope_kv_write",
)


rms_mod, rope_mod, act_mod, kv_mod, rope_kv_mod = import_kernels(
    _KERNEL_MODULES, interpret=not torch.cuda.is_available())

from flexserve.layers.rmsnorm import RMSNorm  # noqa: E402
from flexserve.layers.rotary import RotaryEmbedding, compute_inv_freq, get_rope_parameters  # noqa: E402

INTERPRETED = is_interpreted(rms_mod._rmsnorm_kernel)
DEVICE = "cpu" if INTERPRETED else "cuda"
RUN_IN_CHILD = INTERPRETED and library_is_compiled()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# (atol, rtol) on O(1) values: one ulp of each dtype (bf16 2^-7 relative, fp16 2^-10), or three
# for bf16 under the interpreter (three truncations in a row).
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (4e-2, 2.4e-2) if INTERPRETED else (1e-2, 8e-3),
}
# Bitwise equality with the eager ops holds where every rounding is the same: fp32 and fp16 under
# the interpreter (numpy rounds to nearest; no FMA contraction). Compiled on the H200, FMA
# contraction moves 16-bit results by one ulp on a few elements (measured 2026-11-21: rotary
# fp16 and bf16), so the GPU checks use the one-ulp tolerances.
BITWISE = {torch.float32: INTERPRETED, torch.float16: INTERPRETED, torch.bfloat16: False}


test_module_in_interpreter_child_process, _triton_interpret = interpreter_hooks(
    __file__, INTERPRETED, RUN_IN_CHILD)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and not torch.isnan(actual).any()
    atol, rtol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=atol, rtol=rtol)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(device=DEVICE, dtype=dtype)


def strided(x: torch.Tensor, pad: int = 7) -> torch.Tensor:
    """x's values as a column slice of a wider tensor: rows strided, last dim contiguous."""
    wide = torch.full((x.shape[0], x.shape[1] + pad), float("nan"), dtype=x.dtype, device=x.device)
    view = wide[:, 3 : 3 + x.shape[1]]
    view.copy_(x)
    return view


# ------------------------------------------------------------------------------------ RMSNorm

# (tokens, hidden): one-row decode, odd width in one tile, SmolLM2's 576 (padded to 1024).
RMS_SHAPES = [(1, 64), (7, 100), (33, 576)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", RMS_SHAPES, ids=str)
def test_rmsnorm_with_residual_matches_reference(shape, dtype):
    x = strided(randn(*shape, dtype=dtype, scale=3.0))
    residual = randn(*shape, dtype=dtype, seed=1)
    weight = randn(shape[1], dtype=dtype, seed=2, scale=0.1) + 1
    out = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    residual_out = torch.full_like(out, float("nan"))
    got, new_residual = rms_mod.rmsnorm(x, weight, 1e-5, residual, out=out, residual_out=residual_out)
    assert got is out and new_residual is residual_out
    expected, expected_residual = rms_mod.rmsnorm_ref(x, weight, 1e-5, residual)
    assert_close(out, expected)
    if BITWISE[dtype]:
        assert torch.equal(residual_out, expected_residual)
    else:
        assert_close(residual_out, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_rmsnorm_without_residual_and_in_place(dtype):
    x = randn(5, 300, dtype=dtype, seed=3)
    residual = randn(5, 300, dtype=dtype, seed=4)
    weight = randn(300, dtype=dtype, seed=5, scale=0.1) + 1
    out = torch.full_like(x, float("nan"))
    assert rms_mod.rmsnorm(x, weight, 1e-6, out=out) is out
    assert_close(out, rms_mod.rmsnorm_ref(x, weight, 1e-6))
    expected, expected_residual = rms_mod.rmsnorm_ref(x, weight, 1e-6, residual)
    # vLLM-style in place: x becomes the normed output, residual the new residual.
    got, new_residual = rms_mod.rmsnorm(x, weight, 1e-6, residual, out=x, residual_out=residual)
    assert got is x and new_residual is residual
    assert_close(x, expected)
    assert_close(residual, expected_residual)


def test_rmsnorm_fp32_weight_promotes_like_the_module():
    x = randn(4, 96, dtype=torch.bfloat16, seed=6)
    weight = randn(96, seed=7, scale=0.1) + 1
    out = rms_mod.rmsnorm(x, weight, 1e-6)
    expected = rms_mod.rmsnorm_ref(x, weight, 1e-6)
    assert out.dtype == expected.dtype == torch.float32
    # The normalized x is rounded to bf16 before the fp32 weight multiply: bf16's tolerance.
    atol, rtol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_rmsnorm_reference_is_the_module(dtype, monkeypatch):
    monkeypatch.setenv("FLEXSERVE_KERNELS", "torch")  # the module's torch path, not the kernel
    norm = RMSNorm(100, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(100) + 0.5)
    x, residual = randn(6, 100, dtype=dtype).cpu(), randn(6, 100, dtype=dtype, seed=1).cpu()
    with torch.no_grad():
        assert torch.equal(norm(x), rms_mod.rmsnorm_ref(x, norm.weight, 1e-5))
        for a, b in zip(norm(x, residual), rms_mod.rmsnorm_ref(x, norm.weight, 1e-5, residual)):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------------- rotary

LLAMA31_ROPE = SimpleNamespace(rope_theta=500000.0, rope_scaling={
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192})


def make_rope(head_dim: int, max_position: int) -> RotaryEmbedding:
    inv_freq, scaling = compute_inv_freq(get_rope_parameters(LLAMA31_ROPE), head_dim, max_position)
    with torch.device(DEVICE):
        return RotaryEmbedding(head_dim, max_position, inv_freq, scaling)


def qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q [T, H*D] and k [T, KV*D] as column slices of one fused qkv output (strided rows)."""
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed)
    q = qkv[:, : num_heads * head_dim]
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    return qkv, q, k


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_rotary_matches_reference(head_dim, dtype):
    num_tokens, num_heads, num_kv_heads = 11, 5, 1
    rope = make_rope(head_dim, 4000)
    g = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 4000, (num_tokens,), generator=g).to(DEVICE)  # unsorted
    qkv, q, k = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    expected_qkv, eq, ek = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    rope_mod.rotary_embedding_ref(positions, eq, ek, rope.cos_sin_cache, head_dim)
    got_q, got_k = rope_mod.rotary_embedding(positions, q, k, rope.cos_sin_cache, head_dim)
    assert got_q is q and got_k is k
    if BITWISE[dtype]:
        assert torch.equal(qkv, expected_qkv)  # v untouched, q and k exact
    else:
        assert_close(qkv, expected_qkv)


def test_rotary_takes_3d_views_and_int32_positions():
    rope = make_rope(64, 100)
    q = randn(9, 4, 64, seed=8)
    k = randn(9, 2, 64, seed=9)
    positions = torch.arange(90, 99, dtype=torch.int32, device=DEVICE)
    eq, ek = q.clone(), k.clone()
    rope_mod.rotary_embedding_ref(positions, eq, ek, rope.cos_sin_cache, 64)
    rope_mod.rotary_embedding(positions, q, k, rope.cos_sin_cache, 64)
    assert_close(q, eq)
    assert_close(k, ek)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_rotary_reference_is_the_layer(dtype):
    rope = make_rope(64, 512)
    positions = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    q, k = randn(7, 3 * 64, dtype=dtype), randn(7, 64, dtype=dtype, seed=1)
    expected_q, expected_k = rope(positions, q, k)
    rope_mod.rotary_embedding_ref(positions, q, k, rope.cos_sin_cache, 64)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


# ------------------------------------------------------------------ rotary + KV-cache write


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(5, 1, 64), (12, 4, 128), (8, 8, 80)])
def test_rope_kv_write_equals_rotary_then_cache_write(num_heads, num_kv_heads, head_dim, dtype):
    num_tokens, block_size, num_blocks = 13, 4, 9
    rope = make_rope(head_dim, 600)
    g = torch.Generator().manual_seed(num_heads)
    positions = torch.randint(0, 600, (num_tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 7]] = -1  # CUDA-graph padding: rotated, not written
    slots = slots.to(DEVICE)
    results = []
    for fused in (False, True):
        qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=5)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim], dim=1)
        cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=6)
        if fused:
            got_q, got_k = rope_kv_mod.rope_kv_write(positions, q, k, v, rope.cos_sin_cache,
                                                     cache, slots, head_dim)
            assert got_q is q and got_k is k
        else:
            rope_mod.rotary_embedding_ref(positions, q, k, rope.cos_sin_cache, head_dim)
            heads = (num_tokens, num_kv_heads, head_dim)
            kv_mod.kv_cache_write_ref(k.view(heads), v.view(heads), cache, slots)
        results.append((qkv, cache))
    (expected_qkv, expected_cache), (qkv, cache) = results
    if BITWISE[dtype]:
        assert torch.equal(qkv, expected_qkv) and torch.equal(cache, expected_cache)
    else:
        assert_close(qkv, expected_qkv)
        assert_close(cache, expected_cache)


def test_rope_kv_write_takes_3d_views_and_rejects_bad_inputs():
    rope = make_rope(64, 100)
    q, k, v = randn(3, 4, 64, seed=1), randn(3, 2, 64, seed=2), randn(3, 2, 64, seed=3)
    cache = torch.zeros(2, 2, 4, 2, 64, device=DEVICE)
    slots = torch.tensor([0, 5, 3], device=DEVICE)
    positions = torch.tensor([1, 2, 3], device=DEVICE)
    eq, ek = q.clone(), k.clone()
    rope_mod.rotary_embedding_ref(positions, eq, ek, rope.cos_sin_cache, 64)
    rope_kv_mod.rope_kv_write(positions, q, k, v, rope.cos_sin_cache, cache, slots, 64)
    assert_close(q, eq)
    assert_close(k, ek)
    assert_close(cache[0, 1, 1], ek[1])  # slot 5 = block 1, offset 1
    assert_close(cache[1, 0, 3], v[2])
    with pytest.raises(ValueError, match="head_dim"):
        rope_kv_mod.rope_kv_write(positions, q, k, v, rope.cos_sin_cache, cache, slots, 0)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_kv_mod.rope_kv_write(positions, q, k, v, rope.cos_sin_cache, cache, slots[:2], 64)
    with pytest.raises(ValueError, match="kv_cache"):
        rope_kv_mod.rope_kv_write(positions, q, k, v, rope.cos_sin_cache, cache[:1], slots, 64)
    empty = torch.empty(0, 4, 64, device=DEVICE)
    rope_kv_mod.rope_kv_write(positions[:0], empty, empty[:, :2], empty[:, :2],
                              rope.cos_sin_cache, cache, slots[:0], 64)  # no launch


# ------------------------------------------------------------------------------- SiLU-and-mul


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", [(1, 1), (6, 100), (3, 1500)], ids=str)
def test_silu_and_mul_matches_reference(shape, dtype):
    gate = strided(randn(*shape, dtype=dtype, scale=3.0))
    up = randn(*shape, dtype=dtype, seed=1)
    out = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    assert act_mod.silu_and_mul(gate, up, out=out) is out
    expected = act_mod.silu_and_mul_ref(gate, up)
    assert torch.equal(expected.cpu(), (torch.nn.functional.silu(gate) * up).cpu())  # LlamaMLP
    assert_close(out, expected)
    # One [T, 2d] tensor: a fused gate_up projection.
    fused = torch.cat([gate, up], 1)
    assert_close(act_mod.silu_and_mul(fused), act_mod.silu_and_mul_ref(fused))


# --------------------------------------------------------------------------------- bad inputs


def test_launchers_reject_bad_inputs():
    x, w = randn(3, 64), randn(64)
    with pytest.raises(ValueError, match="weight \\[hidden\\]"):
        rms_mod.rmsnorm(x, w[:10], 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        rms_mod.rmsnorm(x, w, 1e-6, x.half())
    with pytest.raises(ValueError, match="out must be"):
        rms_mod.rmsnorm(x, w, 1e-6, out=x.half())
    with pytest.raises(ValueError, match="contiguous"):
        rms_mod.rmsnorm(x.T.contiguous().T, w, 1e-6)
    with pytest.raises(ValueError, match="hidden size"):
        rms_mod.rmsnorm(randn(1, 40000), randn(40000), 1e-6)
    rope = make_rope(64, 16)
    positions = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of head_dim"):
        rope_mod.rotary_embedding(positions, randn(3, 100), randn(3, 64), rope.cos_sin_cache, 64)
    with pytest.raises(ValueError, match="positions"):
        rope_mod.rotary_embedding(positions[:2], randn(3, 64), randn(3, 64), rope.cos_sin_cache, 64)
    with pytest.raises(ValueError, match="share a dtype"):
        rope_mod.rotary_embedding(positions, randn(3, 64), randn(3, 64).half(), rope.cos_sin_cache, 64)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rope_mod.rotary_embedding(positions, randn(3, 64), randn(3, 64), rope.cos_sin_cache[:, :32], 64)
    with pytest.raises(ValueError, match="2\\*d"):
        act_mod.silu_and_mul(randn(3, 5))
    with pytest.raises(ValueError, match="both be"):
        act_mod.silu_and_mul(randn(3, 4), randn(3, 5))
    with pytest.raises(ValueError, match="share a dtype"):
        act_mod.silu_and_mul(randn(3, 4), randn(3, 4).half())


# ------------------------------------------------------------------- GPU: Llama-3.1-8B shapes


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="Llama-sized shapes only compiled on a GPU")
@pytest.mark.parametrize("num_tokens", [1, 4096])
def test_llama8b_fused_ops_bf16_match_eager(num_tokens):
    # Eager flexserve layers on the GPU in bf16 are the reference. Residual: bitwise; rotary,
    # RMSNorm output and SiLU-and-mul: within one bf16 ulp (on an H200 the eager rotary's fused
    # multiply-adds rounded a few elements 1 ulp apart from the kernel's, e.g. -0.6172 vs -0.6211).
    dtype, hidden, inter, head_dim = torch.bfloat16, 4096, 14336, 128
    norm = RMSNorm(hidden, eps=1e-5).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(hidden, seed=1, scale=0.1) + 1)
        x, residual = randn(num_tokens, hidden, dtype=dtype, seed=2), randn(num_tokens, hidden, dtype=dtype, seed=3)
        expected, expected_residual = norm(x, residual)
        got, new_residual = rms_mod.rmsnorm(x, norm.weight, 1e-5, residual)
        assert torch.equal(new_residual, expected_residual)
        assert_close(got, expected)

        rope = make_rope(head_dim, 8192).to(DEVICE)
        positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE)
        qkv, q, k = qkv_views(num_tokens, 32, 8, head_dim, dtype, seed=4)
        expected_q, expected_k = rope(positions, q.contiguous(), k.contiguous())
        rope_mod.rotary_embedding(positions, q, k, rope.cos_sin_cache, head_dim)
        assert_close(q, expected_q)
        assert_close(k, expected_k)

        gate = randn(num_tokens, inter, dtype=dtype, seed=5, scale=3.0)
        up = randn(num_tokens, inter, dtype=dtype, seed=6)
        assert_close(act_mod.silu_and_mul(gate, up), torch.nn.functional.silu(gate) * up)

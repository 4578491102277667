"""The one-row GEMV (`flexserve_kernels.gemv`) and the row argmax (`flexserve_kernels.argmax`)
vs their torch references, and the layers that dispatch to them (`flexserve.layers.linear.dense`,
`flexserve.layers.sampler.row_argmax`).

Interpreted on CPU (set up as in test_attention_kernels.py), compiled on the GPU.

Tolerances: the GEMV sums in fp32 in its own order and rounds once, so it is checked against
the fp32 sum rounded once to the dtype (`exact`): fp32 results agree to 1e-5 relative plus
summation-order error, 16-bit ones within one ulp of the output (bf16 2^-7, fp16 2^-10
relative; two ulps for bf16 under the interpreter, which truncates instead of rounding). cuBLAS
itself is not the oracle in 16 bits: on the H200 its fp16 result for a [2, 1000] x [1000, 100]
product was further than this from the fp32 sum rounded once (torch lets cuBLAS reduce fp16 at
reduced precision by default, allow_fp16_reduced_precision_reduction).
The argmax is exact: the same index as torch.argmax, ties and NaNs included.
"""

from __future__ import annotations

import pytest
import torch

from flexserve_kernels.configs import kernel_configs

from _triton_interpret import import_kernels, interpreter_hooks, is_interpreted, library_is_compiled

gemv_mod, argmax_mod = import_kernels(
    ("flexserve_kernels.gemv", "flexserve_kernels.argmax"), interpret=not torch.cuda.is_available())

INTERPRETED = is_interpreted(gemv_mod._gemv_kernel)
DEVICE = "cpu" if INTERPRETED else "cuda"
RUN_IN_CHILD = INTERPRETED and library_is_compiled()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3,
        torch.bfloat16: 1.6e-2 if INTERPRETED else 8e-3}

test_module_in_interpreter_child_process, _triton_interpret = interpreter_hooks(
    __file__, INTERPRETED, RUN_IN_CHILD)


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float,
                     magnitude: torch.Tensor | None = None) -> None:
    """|actual - expected| <= rtol * |expected| + 1e-6 * magnitude: the output's rounding plus
    fp32 summation-order error, which scales with sum_k |x_k w_k| (`magnitude`, same shape),
    not with a result that cancelled to near zero."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    diff = (actual.float() - expected.float()).abs()
    bound = rtol * expected.float().abs()
    if magnitude is not None:
        bound += 1e-6 * magnitude.float()
    assert bool((diff <= bound).all()), f"max excess {(diff - bound).max().item()}"


def exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear summed in fp32 and rounded once to x's dtype (then stored as `out_dtype`)."""
    y = gemv_mod.gemv_ref(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)
    return y if out_dtype is None else y.to(out_dtype)


def magnitude(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k |x_k w_k| (+ |b|) per output, in fp32."""
    out = x.float().abs() @ w.float().abs().t()
    return out if bias is None else out + bias.float().abs()


# (M, N, K): odd N and K (masked tiles, K below one tile), tuned shape class, a K that is not a
# multiple of the tile.
GEMV_SHAPES = [(1, 1, 1), (1, 33, 17), (1, 64, 1024), (2, 100, 1000), (3, 9, 2050), (4, 128, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_gemv_matches_linear(shape, dtype, with_bias):
    m, n, k = shape
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype, seed=1)
    bias = randn(n, dtype=dtype, seed=2) if with_bias else None
    assert_close_rel(gemv_mod.gemv(x, w, bias), exact(x, w, bias), RTOL[dtype],
                     magnitude(x, w, bias))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
def test_gemv_fp32_out_is_linear_then_float(dtype):
    """lm_head's logits: rounded to the input dtype first, so every value is one F.linear(...)
    .float() can produce (within an ulp), not the unrounded fp32 sum."""
    x, w = randn(1, 300, dtype=dtype), randn(77, 300, dtype=dtype, seed=1)
    out = gemv_mod.gemv(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, out.to(dtype).float())  # representable in the input dtype
    assert_close_rel(out, exact(x, w, out_dtype=torch.float32), RTOL[dtype], magnitude(x, w))


def test_gemv_strided_rows_and_tuned_configs():
    """Row-strided x and weight (column slices, as a merged projection's views are), and every
    tile shape the config table can pick, on a shape that does not divide them."""
    wide_x, wide_w = randn(1, 700), randn(50, 700, seed=1)
    x, w = wide_x[:, 3:603], wide_w[:, 5:605]
    expected = gemv_mod.gemv_ref(x, w)
    shapes = kernel_configs()["gemv"]["by_shape"]
    configs = [gemv_mod.gemv_config(1, 1), *(gemv_mod.gemv_config(*map(int, shape.split("x"))) for shape in shapes)]
    for config in configs:
        assert_close_rel(gemv_mod.gemv(x, w, config=dict(config)), expected, RTOL[torch.float32],
                         magnitude(x, w))


def test_gemv_rejects_bad_input():
    x, w = randn(1, 8), randn(4, 8)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        gemv_mod.gemv(randn(5, 8), w)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        gemv_mod.gemv(x, randn(4, 9))
    with pytest.raises(ValueError, match="share a dtype"):
        gemv_mod.gemv(x, w.half())
    with pytest.raises(ValueError, match="contiguous"):
        gemv_mod.gemv(x, randn(8, 4).t())
    with pytest.raises(ValueError, match="bias"):
        gemv_mod.gemv(x, w, randn(5))
    with pytest.raises(ValueError, match="out_dtype"):
        gemv_mod.gemv(x, w, out_dtype=torch.int32)


def test_gemv_empty_k_is_bias():
    x, w, b = randn(1, 0), randn(3, 0), randn(3)
    assert torch.equal(gemv_mod.gemv(x, w, b), b[None, :])
    assert torch.equal(gemv_mod.gemv(x, w), torch.zeros(1, 3, device=DEVICE))


# ------------------------------------------------------------------------------------ argmax

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("vocab", [1, 5, 4096, 4097, 49152, 128256], ids=str)
def test_argmax_matches_torch(vocab, dtype):
    logits = randn(3, vocab, dtype=dtype, seed=vocab)
    assert torch.equal(argmax_mod.argmax(logits), argmax_mod.argmax_ref(logits))


def test_argmax_ties_nans_infs_and_signed_zeros():
    nan, inf = float("nan"), float("inf")
    rows = [
        [1.0, 3.0, 3.0, 2.0, 3.0],        # first of a tie
        [-0.0, 0.0, -1.0, -2.0, -3.0],    # -0.0 == 0.0: the first
        [0.0, -0.0, -1.0, -2.0, -3.0],
        [-inf, -inf, -inf, -inf, -inf],   # all -inf: index 0
        [1.0, inf, nan, inf, 2.0],        # NaN beats +inf
        [-5.0, -4.0, -3.0, -4.5, -3.0],   # negatives
    ]
    logits = torch.tensor(rows, device=DEVICE)
    assert torch.equal(argmax_mod.argmax(logits), logits.argmax(dim=-1))
    # A tie that spans two chunks: the earlier chunk wins.
    wide = torch.zeros(2, 3 * 4096 + 5, device=DEVICE)
    wide[:, 4096 * 2 + 1] = 7.0
    wide[:, 4096 + 3] = 7.0
    wide[1, 4096 * 3 + 4] = float("nan")
    assert argmax_mod.argmax(wide).tolist() == wide.argmax(dim=-1).tolist() == [4099, 12292]


def test_argmax_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        argmax_mod.argmax(randn(5))
    with pytest.raises(ValueError, match="empty"):
        argmax_mod.argmax(randn(2, 0))
    with pytest.raises(ValueError, match="contiguous"):
        argmax_mod.argmax(randn(6, 4).t())
    assert argmax_mod.argmax(randn(0, 9)).shape == (0,)


# ------------------------------------------------------------------------------------ dispatch

def test_dense_and_row_argmax_dispatch(monkeypatch):
    """`dense` takes the GEMV for one row on the Triton path and F.linear otherwise (more rows,
    the torch backend); `row_argmax` the kernel or torch. Both
    give the references' answers either way."""
    from flexserve.layers import linear
    from flexserve.layers.sampler import row_argmax

    calls = []
    real = gemv_mod.gemv
    monkeypatch.setattr(gemv_mod, "gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    x, w = randn(3, 40), randn(24, 40, seed=1)
    assert_close_rel(linear.dense(x[:1], w, out_dtype=torch.float32), x[:1] @ w.t(), 1e-5, magnitude(x[:1], w))
    assert_close_rel(linear.dense(x, w), x @ w.t(), 1e-5, magnitude(x, w))
    assert calls == [1]  # one row only
    column_major = x.t().contiguous().t()[:1]  # a row whose elements are strided: F.linear
    assert_close_rel(linear.dense(column_major, w), x[:1] @ w.t(), 1e-5, magnitude(x[:1], w))
    assert calls == [1]
    monkeypatch.setenv("FLEXSERVE_KERNELS", "torch")
    linear.dense(x[:1], w)
    assert calls == [1]
    logits = randn(4, 1000)
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
    monkeypatch.delenv("FLEXSERVE_KERNELS")
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(row_argmax(logits.t().contiguous().t()), logits.argmax(dim=-1))  # strided: torch

"""The latency model (pure Python): shapes, the window search, the NNLS fit, profile files, and
the online correction and conservative fallback the scheduler holds. Synthetic data only."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random

import pytest

from flexserve.engine.iteration_shape import (
    IterationShape,
    backward_window_shape,
    forward_window_shape,
    inference_row_shape,
    plan_shape,
)
from flexserve.engine.latency_model import (
    LatencyModel,
    default_knots,
    load_matching_profile,
    max_window,
    nnls,
    profile_path,
)
from flexserve.engine.online_latency_model import OnlineLatencyModel
from flexserve.engine.plan import BackwardWindow, BatchPlan, FinetuneWindow, ScheduledSequence
from flexserve.sampling_params import SamplingParams

KNOTS = [16, 32, 64, 128, 256, 512]
# A device: 5 ms per forward, 1 ms more when not decode-only, 40 us per token, steeper past 256
# tokens, plus per-row, per-key, per-pair, per-window and per-token costs.
TRUE = {
    "intercept": 0.0005, "forward": 0.005, "eager": 0.001, "forward_tokens": 4e-5,
    "forward_tokens_over_16": 0.0, "forward_tokens_over_32": 0.0, "forward_tokens_over_64": 0.0,
    "forward_tokens_over_128": 0.0, "forward_tokens_over_256": 3e-5,
    "forward_tokens_over_512": 0.0, "decode_rows": 1e-4, "decode_context": 2e-7,
    "attention": 1e-8, "finetune_windows": 5e-4, "finetune_tokens": 6e-5,
    "backward_windows": 3e-4, "backward_tokens": 4e-6, "backward_attention": 2e-9,
}


def true_model() -> LatencyModel:
    return LatencyModel.from_dict({"format": "flexserve-latency-model", "version": 1,
                                   "knots": KNOTS, "coefficients": TRUE, "metadata": {}})


def random_shape(rng: random.Random) -> IterationShape:
    shape = IterationShape()
    if rng.random() < 0.6:
        shape += inference_row_shape(rng.randrange(0, 2048), rng.randrange(2, 1024))
    for _ in range(rng.choice([0, 1, 8, 64])):
        shape += inference_row_shape(rng.randrange(0, 4096), 1)
    if rng.random() < 0.5:
        shape += forward_window_shape(rng.randrange(0, 2048), rng.randrange(1, 512))
    for _ in range(rng.choice([0, 0, 1, 3])):
        start = rng.randrange(0, 2048)
        shape += backward_window_shape(start, start + rng.randrange(1, 512))
    return shape


def samples_of(model: LatencyModel, n: int, seed: int, noise: float = 0.0):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        shape = random_shape(rng)
        if shape.total_forward_tokens or shape.backward_tokens:
            out.append((shape, model.predict(shape) * (1 + noise * rng.uniform(-1, 1))))
    return out


# ----------------------------------------------------------------------------------- shapes
def test_shapes_of_rows_and_windows():
    assert inference_row_shape(10, 1) == IterationShape(decode_rows=1, decode_context=11)
    # 4 queries after 6 cached keys: 4*6 + (1+2+3+4) query-key pairs
    assert inference_row_shape(6, 4) == IterationShape(prefill_tokens=4, prefill_attention=34)
    assert forward_window_shape(6, 4) == IterationShape(
        finetune_tokens=4, finetune_attention=34, finetune_windows=1)
    assert backward_window_shape(6, 10) == IterationShape(
        backward_tokens=4, backward_attention=34, backward_windows=1)
    assert backward_window_shape(5, 5) == IterationShape()
    total = inference_row_shape(6, 4) + forward_window_shape(0, 2)
    assert total.total_forward_tokens == 6 and total.prefill_attention == 34
    assert total.finetune_attention == 3


def test_plan_shape_counts_every_kind_of_work():
    params = SamplingParams()

    def row(rid, computed, n):
        return ScheduledSequence(rid, [1] * n, computed, [0], True, params, [1], [], None, None)

    plan = BatchPlan(
        sequences=[row("a", 0, 8), row("b", 100, 1), row("c", 7, 1)],
        finetune_windows=[FinetuneWindow("j", 0, 16, 20, 0)],
        backward_windows=[BackwardWindow("j", 1, 3, 12, 16), BackwardWindow("j", 1, 3, 0, 12)],
    )
    assert plan_shape(plan) == IterationShape(
        prefill_tokens=8, prefill_attention=36, decode_rows=2, decode_context=109,
        finetune_tokens=4, finetune_attention=74, backward_tokens=16,
        backward_attention=4 * 12 + 10 + 12 * 13 // 2, backward_windows=2, finetune_windows=1)


def test_plan_shape_is_the_sum_of_its_parts_shapes():
    """Counted in place, a plan's shape equals the sum of its rows' and windows' shapes."""
    import random

    rng = random.Random(3)
    params = SamplingParams()
    for _ in range(50):
        rows = [(rng.randrange(0, 500), rng.choice([1, 1, 1, rng.randrange(2, 64)]))
                for _ in range(rng.randrange(0, 40))]
        forward = [(s, s + rng.randrange(0, 40)) for s in rng.sample(range(0, 400), 3)]
        backward = [(s, s + rng.randrange(0, 40)) for s in rng.sample(range(0, 400), 3)]
        plan = BatchPlan(
            sequences=[ScheduledSequence(str(i), [1] * n, c, [0], True, params, [1], [], None,
                                         None) for i, (c, n) in enumerate(rows)],
            finetune_windows=[FinetuneWindow("j", 0, a, b, 0) for a, b in forward],
            backward_windows=[BackwardWindow("j", 1, 3, a, b) for a, b in backward])
        want = IterationShape()
        for c, n in rows:
            want += inference_row_shape(c, n)
        for a, b in forward:
            want += forward_window_shape(a, b - a)
        for a, b in backward:
            want += backward_window_shape(a, b)
        assert plan_shape(plan) == want


# ------------------------------------------------------------------------------ max_window
class Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, s):
        self.calls += 1
        return self.fn(s)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 100, 4096, 100_000])
def test_max_window_is_the_largest_fitting_size(max_tokens):
    for per_token, overhead, limit in ((1.0, 0.0, 50.5), (0.01, 3.0, 7.0), (2.0, 1.0, 1e9)):
        cost = Counted(lambda s: overhead + per_token * s)
        expected = max(0, min(max_tokens, math.floor((limit - overhead) / per_token)))
        assert max_window(cost, limit, max_tokens) == expected
        assert cost.calls <= 2 + math.ceil(math.log2(max_tokens + 1))


def test_max_window_edge_cases():
    assert max_window(lambda s: 10.0, 5.0, 100) == 0  # nothing fits, not even one token
    assert max_window(lambda s: 0.0, 5.0, 100) == 100  # everything fits
    never = Counted(lambda s: 0.0)
    assert max_window(never, 5.0, 0) == 0 and never.calls == 0
    assert max_window(lambda s: 0.0, 5.0, -3) == 0
    assert max_window(lambda s: s * s, 50.0, 1000) == 7  # convex costs too
    assert max_window(lambda s: math.inf if s > 16 else 1.0, 2.0, 4096) == 16
    assert max_window(lambda s: math.nan, 2.0, 4096) == 0  # NaN never fits
    # A step function: flat, then a jump past 37.
    assert max_window(lambda s: 1.0 if s <= 37 else 9.0, 5.0, 1 << 20) == 37


# ------------------------------------------------------------------------------------ NNLS
def test_nnls_matches_known_solutions():
    np = pytest.importorskip("numpy")
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert np.allclose(nnls(a, np.array([1.0, 2.0, 3.0])), [1.0, 2.0])
    # The unconstrained optimum has x0 < 0; NNLS clamps it and refits x1: b = [-1, 1, 0]
    x = nnls(a, np.array([-1.0, 1.0, 0.0]))
    assert np.allclose(x, [0.0, 0.5])
    rng = np.random.default_rng(0)
    a = rng.random((40, 6))
    b = a @ np.array([0.0, 1.5, 0.0, 2.0, 0.25, 0.0])
    assert np.allclose(nnls(a, b), [0.0, 1.5, 0.0, 2.0, 0.25, 0.0], atol=1e-9)


def test_fit_recovers_known_coefficients():
    samples = samples_of(true_model(), 300, seed=1)
    model = LatencyModel.fit(samples, knots=KNOTS)
    for name, value in model.coefficient_dict().items():
        assert value == pytest.approx(TRUE[name], rel=1e-5, abs=1e-12), name
    assert model.metadata["fit"]["max_rel_error"] < 1e-6
    assert model.metadata["fit"]["num_samples"] == 300


def test_fit_on_noisy_data_is_close_and_monotone():
    train = samples_of(true_model(), 400, seed=2, noise=0.05)
    model = LatencyModel.fit(train)
    assert model.knots == default_knots(max(s.total_forward_tokens for s, _ in train))
    report = model.evaluate(samples_of(true_model(), 100, seed=3))
    assert report["num_samples"] == 100
    assert report["median_rel_error"] < 0.03
    # Monotone non-decreasing in every field, from many random points and step sizes.
    rng = random.Random(4)
    for _ in range(300):
        shape = random_shape(rng)
        base = model.predict(shape)
        for field in dataclasses.fields(IterationShape):
            bigger = dataclasses.replace(
                shape, **{field.name: getattr(shape, field.name) + rng.choice([1, 7, 300])})
            assert model.predict(bigger) >= base - 1e-15, field.name


def test_fit_rejects_bad_samples():
    with pytest.raises(ValueError):
        LatencyModel.fit([])
    with pytest.raises(ValueError):
        LatencyModel.fit([(IterationShape(decode_rows=1, decode_context=1), 0.0)])
    with pytest.raises(ValueError):
        LatencyModel([1.0, -1.0] + [0.0] * 12, [])


# ------------------------------------------------------------------------------- files
def test_save_load_round_trip(tmp_path):
    model = LatencyModel.fit(samples_of(true_model(), 100, seed=5, noise=0.02),
                             metadata={"device_name": "cpu", "model": "m", "dtype": "float32"})
    path = tmp_path / "sub" / "p.json"
    model.save(str(path))
    assert os.listdir(path.parent) == ["p.json"]  # the temporary file was renamed
    loaded = LatencyModel.load(str(path))
    assert loaded.coefficients == model.coefficients and loaded.knots == model.knots
    assert loaded.metadata == json.loads(json.dumps(model.metadata))
    shape = random_shape(random.Random(6))
    assert loaded.predict(shape) == model.predict(shape)
    data = model.to_dict()
    assert LatencyModel.from_dict(data).coefficient_dict() == model.coefficient_dict()
    for bad in ({}, {**data, "format": "x"}, {**data, "version": 99},
                {**data, "coefficients": {"forward": 1.0}}):
        with pytest.raises(ValueError):
            LatencyModel.from_dict(bad)
    path.write_text("{not json")
    with pytest.raises(ValueError):
        LatencyModel.load(str(path))


def test_profile_path_and_matching(tmp_path):
    path = profile_path(str(tmp_path), "NVIDIA H200", "/models/Llama 3/8B", "bfloat16")
    assert path == str(tmp_path / "profiles" / "nvidia-h200__models-llama-3-8b__bfloat16.json")
    assert load_matching_profile(str(tmp_path), "NVIDIA H200", "/models/Llama 3/8B",
                                 "bfloat16") is None
    meta = {"device_name": "NVIDIA H200", "model": "/models/Llama 3/8B", "dtype": "bfloat16"}
    model = LatencyModel.fit(samples_of(true_model(), 50, seed=7), metadata=meta)
    model.save(path)
    found = load_matching_profile(str(tmp_path), "NVIDIA H200", "/models/Llama 3/8B", "bfloat16")
    assert found is not None and found.coefficients == model.coefficients
    # Same slug, other model (sanitizing mapped both to one name): not this model's profile.
    assert load_matching_profile(str(tmp_path), "NVIDIA H200", "models/Llama-3/8B",
                                 "bfloat16") is None
    with open(path, "w") as f:
        f.write("garbage")
    assert load_matching_profile(str(tmp_path), "NVIDIA H200", "/models/Llama 3/8B",
                                 "bfloat16") is None


# ---------------------------------------------------------------------- online correction
def test_online_model_follows_a_drifted_device():
    base = true_model()
    online = OnlineLatencyModel(base, ewma_alpha=0.1)
    assert not online.is_fallback and online.error_ratio == 0.0 and online.num_observed == 0
    stream = samples_of(base, 1000, seed=8)
    for shape, seconds in stream[:5]:
        online.observe(shape, 1.5 * seconds)
    early_error = online.error_ratio  # |1 - 1.5| / 1.5 at first, shrinking as the scale moves
    assert 0.2 < early_error < 1 / 3
    for shape, seconds in stream[5:]:
        online.observe(shape, 1.5 * seconds)
    assert online.num_observed == 1000
    # Backward windows are a small share of these iterations (~1% of the prediction, median):
    # their scale moves by that share, so it follows in ~1000 iterations where the forward's
    # follows in ~50; the prediction is within 0.2% of the device's.
    assert online.scale == pytest.approx(1.5, rel=2e-3)
    assert online.backward_scale == pytest.approx(1.5, rel=2e-2)
    assert online.error_ratio < 0.01 < early_error
    shape = stream[0][0]
    assert online.predict(shape) == pytest.approx(1.5 * base.predict(shape), rel=2e-3)


def test_online_model_corrects_backward_windows_on_their_own():
    # The profile under-predicts backward windows 2x (its windows were short) and is right
    # about everything else: the backward correction takes the error, the forward's stays.
    profile = true_model()
    device = LatencyModel.from_dict({
        "format": "flexserve-latency-model", "version": 1, "knots": KNOTS, "metadata": {},
        "coefficients": {name: 2 * c if name.startswith("backward_") else c
                         for name, c in TRUE.items()}})
    online = OnlineLatencyModel(profile, ewma_alpha=0.1)
    for shape, seconds in samples_of(device, 600, seed=3):
        online.observe(shape, seconds)
    assert online.scale == pytest.approx(1.0, rel=0.05)
    assert online.backward_scale == pytest.approx(2.0, rel=0.05)
    heavy = inference_row_shape(1024, 1)
    decode_only = IterationShape() + heavy
    for start in range(0, 8192, 512):  # one iteration of many long backward windows
        heavy += backward_window_shape(start, start + 512)
    for shape in (heavy, decode_only):
        assert online.predict(shape) == pytest.approx(device.predict(shape), rel=0.05)
    # One scale for both would err on one of them by tens of percent.
    ratio = device.predict(heavy) / profile.predict(heavy)
    assert ratio > 1.5 and device.predict(decode_only) == profile.predict(decode_only)


def test_online_model_outlier_moves_the_scale_a_little():
    base = true_model()
    online = OnlineLatencyModel(base, ewma_alpha=0.1)
    shape = forward_window_shape(0, 64)
    online.observe(shape, 100 * base.predict(shape))  # a lone stall: the scale stays
    assert online.scale == 1.0
    online.observe(shape, 2.5 * base.predict(shape))  # slower, but not a stall
    assert online.scale == pytest.approx(1.1)  # ratio clamped to 2x the scale, times alpha
    online.observe(shape, 0.0)  # ignored
    assert online.num_observed == 2


def test_fallback_is_conservative_and_grows_gradually():
    device = true_model()
    online = OnlineLatencyModel(None)
    assert online.is_fallback and online.model is None
    # Before anything is observed: only the initial window is allowed, however loose the limit.
    inference = inference_row_shape(100, 1) + inference_row_shape(300, 1)
    assert max_window(lambda s: online.predict(inference + forward_window_shape(0, s)),
                      10.0, 4096) == online.initial_window
    assert max_window(lambda s: online.predict(inference + backward_window_shape(0, s)),
                      10.0, 4096) == online.initial_window

    # The scheduler's loop: decode rows of random size, then the largest fitting window.
    rng = random.Random(9)
    limit = 0.05
    windows = []
    for _ in range(400):
        rows = IterationShape()
        for _ in range(rng.randrange(1, 32)):
            rows += inference_row_shape(rng.randrange(16, 2048), 1)
        start = rng.randrange(0, 1024)
        cap_before = online.max_finetune_tokens
        s = max_window(lambda s: online.predict(rows + forward_window_shape(start, s)),
                       limit, 4096)
        assert s <= cap_before  # never beyond 2x what the current fit has seen
        shape = rows + forward_window_shape(start, s)
        measured = device.predict(shape)
        assert measured <= limit  # the fallback never broke the SLO
        online.observe(shape, measured)
        windows.append(s)
    assert windows[0] == 16 and max(windows[:8]) == 16  # no growth before the first fit
    # It grew, and in the end it is within reach of the best window the limit allows.
    best = max_window(lambda s: device.predict(rows + forward_window_shape(start, s)), limit,
                      4096)
    assert max(windows[-20:]) > 64
    assert windows[-1] >= 0.5 * best


def test_lone_stalls_do_not_move_the_online_scale_but_a_slower_device_does():
    model = LatencyModel.fit([(IterationShape(prefill_tokens=n), 0.001 + 1e-5 * n)
                              for n in range(16, 2048, 64)])
    online = OnlineLatencyModel(model)
    shape = IterationShape(prefill_tokens=512)
    base = model.predict(shape)
    for i in range(50):
        # every tenth iteration stalls 20x (a compile, an allocator retry)
        online.observe(shape, base * (20.0 if i % 10 == 0 else 1.0))
    assert online.scale == pytest.approx(1.0, abs=0.05)
    for _ in range(60):  # the device really became 5x slower
        online.observe(shape, base * 5.0)
    assert online.scale > 3.5


def test_fallback_keeps_what_a_refit_still_misses_on_the_newest_iterations():
    """A refit over 512 iterations, mostly older ones, can under-predict the newest (the
    windows that just grew): the scale starts at what the new fit misses on the last 16, not
    at 1."""
    device = true_model()
    online = OnlineLatencyModel(None, refit_interval=16, max_samples=512)
    old = samples_of(device, 496, seed=4)
    for shape, seconds in old:
        online.observe(shape, seconds)
    newest = samples_of(device, 16, seed=5)
    for shape, seconds in newest:
        online.observe(shape, 1.6 * seconds)  # the newest work runs slower than the fit's data
    online._refit()  # as the next due refit does
    fit = online.model
    ratios = sorted(1.6 * s / fit.predict(shape) for shape, s in newest)
    assert online.scale == pytest.approx((ratios[7] + ratios[8]) / 2)
    assert online.scale > 1.3
    shape, seconds = newest[0]
    assert online.predict(shape) == pytest.approx(
        1.6 * seconds * online.safety_factor, rel=0.15)

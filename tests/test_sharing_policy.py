"""Sharing policies: parsing, fixed-frequency temporal sharing, and Dynamic Temporal Sharing
(FlexLLM appendix A, algorithm 3) checked against intervals computed by hand from the algorithm."""

from __future__ import annotations

import pytest

from flexserve.engine.sharing_policy import DynamicTemporalSharing, SharingPolicy, TemporalSharing


def test_policy_parses_names_and_lists_choices():
    assert SharingPolicy.parse("coserve") is SharingPolicy.COSERVE
    assert SharingPolicy.parse(" Dynamic_Temporal ") is SharingPolicy.DYNAMIC_TEMPORAL
    assert SharingPolicy("inference-only") is SharingPolicy.INFERENCE_ONLY
    assert SharingPolicy.parse(SharingPolicy.SPATIAL) is SharingPolicy.SPATIAL
    assert SharingPolicy.TEMPORAL == "temporal"
    with pytest.raises(ValueError) as excinfo:
        SharingPolicy.parse("round-robin")
    message = str(excinfo.value)
    assert "'round-robin'" in message
    for choice in ("coserve", "temporal", "dynamic-temporal", "spatial", "inference-only"):
        assert choice in message
    with pytest.raises(ValueError, match="choose one of"):
        SharingPolicy(3)


@pytest.mark.parametrize("frequency", [1, 3, 64])
def test_temporal_sharing_fires_on_every_nth_iteration(frequency):
    policy = TemporalSharing(frequency)
    due = [policy.after_iteration() for _ in range(5 * frequency)]
    assert [i + 1 for i, d in enumerate(due) if d] == [frequency * k for k in range(1, 6)]


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_temporal_sharing_frequency_is_validated(bad):
    with pytest.raises(ValueError, match="frequency"):
        TemporalSharing(bad)


def feed(dts: DynamicTemporalSharing, steps: list[tuple[int, int, int, int]]) -> list[bool]:
    return [dts.scheduler_step(*step) for step in steps]


def run(dts: DynamicTemporalSharing, step: tuple[int, int, int, int], num_steps: int,
        first_call: int = 1) -> list[tuple[int, float, float, int]]:
    """(call number, new interval s, f_p, d) at each switch over `num_steps` identical steps."""
    switches = []
    for call in range(first_call, first_call + num_steps):
        if dts.scheduler_step(*step):
            # RESET_STATS happens at every switch.
            assert dts.queue_lengths == [] and dts.batch_sizes == []
            assert dts.num_arrivals == 0 and dts.num_completions == 0
            switches.append((call, dts.interval, dts.prev_frequency, dts.decisions))
    return switches


def assert_switches(actual, expected):
    assert [s[0] for s in actual] == [e[0] for e in expected]
    assert [s[3] for s in actual] == [e[3] for e in expected]
    assert [s[1] for s in actual] == pytest.approx([e[1] for e in expected], abs=1e-9)
    assert [s[2] for s in actual] == pytest.approx([e[2] for e in expected], abs=1e-9)


def test_idle_compute_with_no_statistics_returns_64():
    # Lines 20-21: Q empty -> 64, before line 40, so f_p is untouched.
    dts = DynamicTemporalSharing(initial_frequency=200.0)
    assert dts.compute_next_interval() == 64.0
    assert dts.prev_frequency == 200.0 and dts.decisions == 0 and dts.interval == 64.0


def test_light_load_pressure_gives_64_and_line_41_floor_does_not_reach_f_p():
    dts = DynamicTemporalSharing()
    # q = 4, b = 3, a = 2, c = 1 for 10 steps (no switch: s = 64 - 10 = 54).
    # p_q = min(1, 4/20) = 0.2; p_s = min(0.5, 4/25) = 0.16; lambda = 20/10 = 2, mu = 10/10 = 1,
    # p_b = max(0, (2 - 1)/8) = 0.125; p = 0.485 <= 0.8 -> f = 64.
    # f = 64 * 1.35 = 86.4; f_s = (86.4 + 2 * 64)/3 = 71.4667 = f_p; max(71.4667, 80) = 80.
    assert feed(dts, [(4, 3, 2, 1)] * 10) == [False] * 10
    assert dts.interval == 54.0 and dts.queue_lengths == [4] * 10 and dts.batch_sizes == [3] * 10
    assert dts.num_arrivals == 20 and dts.num_completions == 10
    assert dts.compute_next_interval() == pytest.approx(80.0)
    assert dts.prev_frequency == pytest.approx(214.4 / 3)  # 71.4667, not the floored 80
    # p = 0.8 exactly takes the same branch: q = 13, 5, 0 -> p_q = 6/20 = 0.3, p_s = 0.5, p_b = 0.
    # (Interpolation is continuous there, p_n = 0 gives f = 64 too.)
    dts = DynamicTemporalSharing()
    feed(dts, [(13, 1, 0, 0), (5, 1, 0, 0), (0, 1, 0, 0)])
    assert dts.compute_next_interval() == pytest.approx(80.0)
    assert dts.prev_frequency == pytest.approx(214.4 / 3)


def test_heavy_load_pressure_gives_512_and_f_p_can_exceed_the_clamp():
    dts = DynamicTemporalSharing()
    # q = 30, a = 5, c = 1: p_q = min(1, 1.5) = 1; p_s = min(0.5, 1.2) = 0.5;
    # p_b = (5 - 1)/8 = 0.5; p = 2.0 >= 2.0 -> f = 512; f = 512 * 1.35 = 691.2.
    feed(dts, [(30, 16, 5, 1)] * 10)
    # f_s = (691.2 + 2 * 64)/3 = 273.0667 = f_p, inside [80, 512].
    assert dts.compute_next_interval() == pytest.approx(819.2 / 3)
    assert dts.prev_frequency == pytest.approx(819.2 / 3)
    # Hysteresis: the same statistics again, f_s = (691.2 + 2 * 273.0667)/3 = 412.4444.
    assert dts.compute_next_interval() == pytest.approx((691.2 + 2 * 819.2 / 3) / 3)
    # From f_p = 512: f_s = (691.2 + 1024)/3 = 571.7333 = f_p, returned clamped to 512.
    dts = DynamicTemporalSharing(initial_frequency=512.0)
    feed(dts, [(30, 16, 5, 1)] * 10)
    assert dts.compute_next_interval() == 512.0
    assert dts.prev_frequency == pytest.approx(1715.2 / 3)


def test_intermediate_pressure_interpolates():
    dts = DynamicTemporalSharing()
    # Nine steps, q cycling 6, 12, 18 (mean 12, max 18); 27 arrivals in one step and 9 completions
    # in another: lambda = 27/9 = 3, mu = 9/9 = 1 (rates per recorded step).
    # p_q = min(1, 12/20) = 0.6; p_s = min(0.5, 18/25 = 0.72) = 0.5; p_b = (3 - 1)/8 = 0.25;
    # p = 1.35 -> p_n = (1.35 - 0.8)/1.2 = 0.458333; f = 64 + 0.458333 * 0.6 * 448 = 187.2;
    # f = 187.2 * 1.35 = 252.72; f_s = (252.72 + 128)/3 = 126.9067 = f_p.
    steps = [(6, 1, 27, 0), (12, 2, 0, 0), (18, 3, 0, 9)]
    steps += [(6, 1, 0, 0), (12, 2, 0, 0), (18, 3, 0, 0)] * 2
    feed(dts, steps)
    assert dts.compute_next_interval() == pytest.approx(380.72 / 3)
    assert dts.prev_frequency == pytest.approx(380.72 / 3)
    # The batch sizes are recorded but never enter the pressure: other b, same interval.
    other = DynamicTemporalSharing()
    feed(other, [(q, 100 * b, a, c) for q, b, a, c in steps])
    assert other.batch_sizes == [100 * b for _, b, _, _ in steps]
    assert other.compute_next_interval() == pytest.approx(380.72 / 3)


def test_idle_system_switch_points_recompute_every_third_decision():
    dts = DynamicTemporalSharing()
    # s = 64 -> switch on call 64; d = 1 < 3: s = min(512, 64 * 1.1) = 70.4.
    # 70.4 - 70 = 0.4 > 0, so the next switch is 71 calls later (135); d = 2: s = 70.4 again.
    # Call 206: d = 3 -> recompute over the 71 idle steps: p = 0, f = 86.4,
    #   f_s = (86.4 + 128)/3 = 71.4667 = f_p, floored to 80; d = 0.
    # Call 286 (80 calls): d = 1, s = 71.4667 * 1.1 = 78.6133. Call 365 (79 calls): d = 2, same.
    # Call 444 (79 calls): d = 3, f_s = (86.4 + 2 * 71.4667)/3 = 76.4444 = f_p, floored to 80.
    fp1 = 214.4 / 3
    fp2 = (86.4 + 2 * fp1) / 3
    expected = [
        (64, 70.4, 64.0, 1),
        (135, 70.4, 64.0, 2),
        (206, 80.0, fp1, 0),
        (286, fp1 * 1.1, fp1, 1),
        (365, fp1 * 1.1, fp1, 2),
        (444, 80.0, fp2, 0),
    ]
    assert_switches(run(dts, (0, 0, 0, 0), 444), expected)


def test_heavy_load_switch_points_grow_towards_512():
    dts = DynamicTemporalSharing()
    # Every recompute sees p = 2 (f = 691.2); between recomputes s = min(512, 1.1 f_p).
    fp1 = (691.2 + 2 * 64) / 3  # 273.0667 at call 206
    fp2 = (691.2 + 2 * fp1) / 3  # 412.4444 at call 206 + 274 + 301 + 301 = 1082
    fp3 = (691.2 + 2 * fp2) / 3  # 505.3630 at call 1082 + 413 + 454 + 454 = 2403
    fp4 = (691.2 + 2 * fp3) / 3  # 567.3086 at call 2403 + 506 + 512 + 512 = 3933: clamped to 512
    expected = [
        (64, 70.4, 64.0, 1),
        (135, 70.4, 64.0, 2),
        (206, fp1, fp1, 0),
        (480, fp1 * 1.1, fp1, 1),  # 274 calls: 273.0667 - 273 > 0
        (781, fp1 * 1.1, fp1, 2),  # 301 calls (300.3733)
        (1082, fp2, fp2, 0),
        (1495, fp2 * 1.1, fp2, 1),  # 413 calls; 453.6889
        (1949, fp2 * 1.1, fp2, 2),  # 454 calls
        (2403, fp3, fp3, 0),
        (2909, 512.0, fp3, 1),  # 506 calls; 1.1 * 505.363 = 555.9 -> min(512, .) = 512
        (3421, 512.0, fp3, 2),  # 512 calls
        (3933, 512.0, fp4, 0),  # f_p = 567.3 > 512 stays unclamped
    ]
    assert_switches(run(dts, (30, 16, 5, 1), 3933), expected)
    # Load disappears: the next recompute (call 3933 + 512 + 512 + 512 = 5469) sees an idle
    # window but hysteresis keeps the interval long: (86.4 + 2 * 567.3086)/3 = 407.0057.
    after = run(dts, (0, 0, 0, 0), 3 * 512, first_call=3934)
    assert [s[0] for s in after] == [4445, 4957, 5469]
    assert after[-1][1] == pytest.approx((86.4 + 2 * fp4) / 3)


def test_recompute_sees_only_the_steps_since_the_last_switch():
    dts = DynamicTemporalSharing()
    # Heavy load until the second switch (call 135), then idle. RESET_STATS at every switch means
    # the recompute at call 206 sees only the 71 idle steps: p = 0 -> f_s = 71.4667 -> 80.
    switches = run(dts, (30, 16, 5, 1), 135)
    assert [s[0] for s in switches] == [64, 135]
    switches = run(dts, (0, 0, 0, 0), 71, first_call=136)
    assert switches == [(206, pytest.approx(80.0), pytest.approx(214.4 / 3), 0)]


def test_first_switch_uses_the_initial_interval():
    dts = DynamicTemporalSharing(initial_interval=3, initial_frequency=100.0)
    assert feed(dts, [(0, 0, 0, 0)] * 3) == [False, False, True]
    assert dts.interval == pytest.approx(110.0) and dts.decisions == 1


@pytest.mark.parametrize("kwargs,name", [
    ({"initial_interval": 0}, "initial_interval"),
    ({"initial_interval": 2.5}, "initial_interval"),
    ({"initial_frequency": 0.0}, "initial_frequency"),
    ({"initial_frequency": float("nan")}, "initial_frequency"),
    ({"initial_frequency": float("inf")}, "initial_frequency"),
])
def test_dynamic_temporal_sharing_arguments_are_validated(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DynamicTemporalSharing(**kwargs)


def test_scheduler_step_rejects_negative_counts():
    with pytest.raises(ValueError, match="num_arrivals"):
        DynamicTemporalSharing().scheduler_step(0, 0, -1, 0)

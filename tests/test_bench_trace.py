"""Arrival traces for `flexserve bench serve --trace`: loading JSONL and CSV traces (and the Azure
trace's columns), the synthetic bursty trace, the timeline and the options (the replay against
the real server is in test_bench_serve.py, beside its server)."""

from __future__ import annotations

import pytest

from flexserve.bench.serve import parse_bench_serve_args, run_benchmark
from flexserve.bench.trace import TraceEntry, bursty_trace, load_trace, timeline, write_trace


def test_jsonl_trace_is_shifted_sorted_and_keeps_lengths(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 12.5, "input_len": 7, "output_len": 3}\n\n'
                    '{"arrival_time": 10.0}\n{"time": 11, "output_tokens": 4}\n')
    assert load_trace(str(path)) == [TraceEntry(0.0, None, None), TraceEntry(1.0, None, 4),
                                     TraceEntry(2.5, 7, 3)]


def test_csv_trace_with_azure_columns(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n")
    entries = load_trace(str(path))
    assert [(e.prompt_len, e.output_len) for e in entries] == [(374, 44), (396, 109)]
    assert entries[0].arrival_s == 0.0
    assert entries[1].arrival_s == pytest.approx(4.314579, abs=1e-5)


@pytest.mark.parametrize("content,suffix,fragment", [
    ('{"input_len": 3}\n', "jsonl", "no arrival time"),
    ('{"timestamp": "soon"}\n', "jsonl", "neither seconds nor a date-time"),
    ('{"timestamp": 1, "output_len": 0}\n', "jsonl", "output_len must be an integer >= 1"),
    ('{"timestamp": 1, "input_len": 2.5}\n', "jsonl", "input_len must be an integer >= 1"),
    ('[1, 2]\n', "jsonl", "expected an object"),
    ("not json\n", "jsonl", "not JSON"),
    ("", "jsonl", "has no requests"),
    ("time,input_len\nnan,4\n", "csv", "must be finite"),
    ("1,2\n", "txt", "a .jsonl or .csv file"),
])
def test_bad_traces_name_the_file_and_line(tmp_path, content, suffix, fragment):
    path = tmp_path / f"t.{suffix}"
    path.write_text(content)
    with pytest.raises(ValueError, match=fragment):
        load_trace(str(path))


def test_bursty_trace_ramps_up_and_down_and_round_trips(tmp_path):
    entries = bursty_trace(60.0, 2.0, 20.0, seed=3)
    thirds = [sum(lo <= e.arrival_s < lo + 20 for e in entries) for lo in (0, 20, 40)]
    # Expected arrivals per third: 20 s x (2 + 18 x the third's mean ramp 1/3, 5/6, 1/3)
    # = 160 / 340 / 160, 660 in all (a mean rate of 11).
    assert thirds[1] > 1.5 * thirds[0] and thirds[1] > 1.5 * thirds[2]
    assert 550 <= sum(thirds) <= 770
    assert entries == bursty_trace(60.0, 2.0, 20.0, seed=3)  # seeded
    path = tmp_path / "bursty.jsonl"
    write_trace(str(path), entries)
    shifted = [e.arrival_s - entries[0].arrival_s for e in entries]
    assert [e.arrival_s for e in load_trace(str(path))] == pytest.approx(shifted, abs=1e-5)
    with pytest.raises(ValueError):
        bursty_trace(10.0, 5.0, 2.0)


def test_timeline_bins_attainment_and_finetune_rate():
    def request(t, tpot, error=None):
        return {"scheduled_s": t, "tpot_s": tpot, "error": error}

    requests = [request(0.5, 0.01), request(1.0, 0.08), request(2.5, 0.02),
                request(3.0, None, error="boom"), request(3.5, 0.03)]
    samples = [{"t_s": t, "metrics_tokens": {"forward": 100.0 * t}} for t in (0.0, 1.0, 2.0, 3.0)]
    bins = timeline(requests, samples, 2.0, slo_tpot_ms=50.0)
    assert [b["requests"] for b in bins] == [2, 3]
    assert [b["tpot_attainment"] for b in bins] == [0.5, 1.0]
    assert bins[0]["finetune_tokens_per_s"] == pytest.approx(100.0)
    assert bins[1]["request_rate"] == 1.5
    assert timeline(requests, None, 2.0, None)[0]["tpot_attainment"] is None


@pytest.mark.parametrize("argv,fragment", [
    (["--request-rate", "4"], "drop --request-rate"),
    (["--trace-bin-s", "0"], "--trace-bin-s must be"),
])
def test_trace_options_are_checked(tmp_path, argv, fragment):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_time": 0}\n')
    with pytest.raises(ValueError, match=fragment):
        run_benchmark(parse_bench_serve_args(["--base-url", "http://127.0.0.1:9", "--trace",
                                              str(path), *argv]))
    with pytest.raises(ValueError, match="is not a file"):
        run_benchmark(parse_bench_serve_args(["--base-url", "http://127.0.0.1:9", "--trace",
                                              str(tmp_path / "missing.jsonl")]))

"""Iteration traces (FLEXSERVE_ITERATION_TRACE): lines, events, the stall watchdog, the engine."""

from __future__ import annotations

import json
import time

import pytest

from flexserve.engine.iteration_shape import IterationShape
from flexserve.engine.iteration_trace import IterationTrace, load_trace


def test_iteration_lines_round_trip_and_events_are_skipped(tmp_path):
    path = str(tmp_path / "trace.jsonl")
    trace = IterationTrace(path)
    shape = IterationShape(decode_rows=3, decode_context=40, finetune_tokens=128,
                           finetune_attention=8256, finetune_windows=1)
    trace.record(shape, 0.030, 0.041, 1.2, "coserve", 0.039)
    trace.event("triton_compile", kernel="k", seconds=0.9)
    trace.record(IterationShape(), 0.001, 0.002, 1.0, None)
    records = load_trace(path)
    assert [r["shape"] for r in records] == [shape, IterationShape()]
    assert records[0]["seconds"] == 0.041 and records[0]["thread_seconds"] == 0.039
    assert records[0]["mode"] == "coserve" and records[1]["thread_seconds"] is None
    events = [json.loads(line) for line in open(path) if '"event"' in line]
    assert events[0]["event"] == "triton_compile" and events[0]["kernel"] == "k"


def test_a_line_that_is_not_a_record_is_named(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"seconds": 1.0}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        load_trace(str(path))


def test_the_watchdog_dumps_a_long_step_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXSERVE_STALL_DUMP_S", "0.05")
    path = str(tmp_path / "trace.jsonl")
    trace = IterationTrace(path)
    started = [None]
    trace.start_stall_watchdog(lambda: started[0])
    time.sleep(0.1)  # no step running: nothing
    started[0] = time.monotonic()
    time.sleep(0.3)  # one long step: one dump
    started[0] = None
    time.sleep(0.05)
    stalls = [json.loads(line) for line in open(path)]
    assert len(stalls) == 1 and stalls[0]["event"] == "stall"
    assert stalls[0]["seconds"] >= 0.05
    assert any("test_the_watchdog_dumps_a_long_step_once" in s
               for s in stalls[0]["stacks"].values())


def test_the_engine_traces_its_iterations(tmp_path, monkeypatch, tiny_checkpoint, tiny_config):
    from flexserve import LLM, SamplingParams

    path = str(tmp_path / "trace.jsonl")
    monkeypatch.setenv("FLEXSERVE_ITERATION_TRACE", path)
    llm = LLM(tiny_checkpoint(tiny_config("llama", num_hidden_layers=2)), max_model_len=64,
              dtype="float32")
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    records = load_trace(path)
    assert len(records) >= 3
    assert records[0]["shape"].prefill_tokens > 0
    assert all(r["seconds"] > 0 and r["thread_seconds"] is not None for r in records)
    assert sum(r["shape"].decode_rows for r in records) >= 2

"""benchmarks/multi_job.py runs end to end on the CPU (`--tiny`): both modes train the same jobs
(the same tokens), concurrently with every job on the engine at once."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "multi_job.py"


@pytest.mark.slow
def test_multi_job_benchmark_smoke():
    out = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--num-jobs", "3"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    by_mode = {r["mode"]: r for r in records if "mode" in r}
    first = by_mode.pop("first job")  # the warm-up job
    assert 0 <= first["start_seconds"] <= first["seconds"]
    assert set(by_mode) == {"concurrent", "sequential"}
    assert by_mode["concurrent"]["tokens"] == by_mode["sequential"]["tokens"] > 0
    assert by_mode["concurrent"]["max_jobs_at_once"] == 3
    assert by_mode["sequential"]["max_jobs_at_once"] == 1
    speedup = [r for r in records if "speedup_concurrent_vs_sequential" in r]
    assert len(speedup) == 1 and speedup[0]["num_jobs"] == 3
    for r in by_mode.values():  # every layer-window of the backward is counted once
        windows = r["backward_windows"]
        assert windows["graphs"] + windows["eager"] > 0
        assert windows["across_jobs"] <= windows["together"] <= windows["graphs"]


@pytest.mark.slow
def test_multi_job_benchmark_profile():
    out = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--num-jobs", "2",
                          "--modes", "concurrent", "--profile"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    profiled = [line for line in out.splitlines() if line.startswith("profiled run:")]
    assert len(profiled) == 1 and "backward windows" in profiled[0]
    assert "Ordered by: internal time" in out and "Ordered by: cumulative time" in out

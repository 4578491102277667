"""benchmarks/allreduce.py runs end to end on the CPU (gloo, 2 ranks): one record per batch size
with the step's all-reduce count and payload."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "allreduce.py"


def test_allreduce_benchmark_smoke():
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--num-layers", "2",
                          "--iters", "2", "--batch-sizes", "1", "4", "--hidden-size", "64"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["method"], r["batch"]) for r in records] == [("gloo", 1), ("gloo", 4)]
    assert all(r["allreduces_per_step"] == 4 and r["ms_per_step"] > 0 for r in records)
    assert [r["bytes_each"] for r in records] == [128, 512]

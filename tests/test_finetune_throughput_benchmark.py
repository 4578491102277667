"""benchmarks/finetune_throughput.py's HF + PEFT baseline runs on the CPU: one row per
(targets, length, gradient checkpointing), each with its own finite losses."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "finetune_throughput.py"


@pytest.mark.slow
def test_hf_peft_baseline_rows(tmp_path):
    out = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, str(SCRIPT), "--model", "smollm2-135m-instruct",
                    "--backends", "hf-peft", "--seq-lens", "16", "--num-sequences", "1",
                    "--targets", "down_proj", "--hf-gradient-checkpointing", "off", "on",
                    "--out", str(out)],
                   capture_output=True, text=True, timeout=600, check=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    rows = [r for r in rows if r.get("backend") == "hf-peft"]
    assert [r["gradient_checkpointing"] for r in rows] == ["off", "on"]
    for r in rows:
        assert r["targets"] == "down_proj" and r["seq_len"] == 16 and r["tokens_per_s"] > 0
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])

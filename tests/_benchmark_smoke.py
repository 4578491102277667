"""Runs a GPU benchmark script's --smoke mode (tiny shapes, Triton's interpreter, untimed) in a
fresh process, for the tests that check every path of a benchmark writes a correct row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def smoke_rows(script: str, out: Path, timeout: float = 300) -> list[dict]:
    """The JSON lines `python <script> --smoke --out <out>` writes (run from the repository root,
    the interpreter left for the script to set)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, script, "--smoke", "--out", str(out)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]

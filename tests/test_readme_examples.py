"""The README's Python examples run as printed and do what they say.

Every ```python block of README.md runs as a user would paste it: a fresh interpreter in an empty
directory. The comment on the line before a block decides how:
- none: the block runs alone;
- `<!-- test: server -->`: the blocks so marked run in order in one interpreter, against a real
  `flexserve serve` (its default options) on a free port in place of localhost:8000;
- `<!-- test: skip (reason) -->`: not run (the reason says why).
Beyond exiting cleanly, the fine-tuning examples must print the taught fact after training and
the base model must not.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _server_process import ServerProcess

README = Path(__file__).resolve().parents[1] / "README.md"
FACT = "tangerine-42."
BLOCK = re.compile(r"(?:<!-- test: (?P<mark>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)

pytestmark = pytest.mark.slow


def readme_blocks() -> list[tuple[str, str]]:
    """(mark, code) of every python block; mark is "" for a block without a test comment."""
    blocks = [(m.group("mark") or "", m.group("code")) for m in BLOCK.finditer(README.read_text())]
    for mark, _ in blocks:
        if mark not in ("", "server") and not mark.startswith("skip ("):
            raise ValueError(f"README.md: unknown test mark {mark!r}")
    return blocks


def run_python(code: str, cwd: Path, timeout: float) -> str:
    """Run `code` as a script in `cwd`; its stdout, or a failure showing both streams."""
    script = cwd / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


def test_readme_marks_every_example():
    blocks = readme_blocks()
    assert len(blocks) >= 3
    assert any(mark == "" and "llm.finetune(" in code for mark, code in blocks)
    assert any(mark == "server" and "fine_tuning.jobs.create(" in code for mark, code in blocks)


@pytest.mark.timeout(600)
def test_offline_examples_run_and_learn_what_they_claim(smollm2_dir, tmp_path):
    blocks = [code for mark, code in readme_blocks() if mark == ""]
    for i, code in enumerate(blocks):
        cwd = tmp_path / f"block{i}"
        cwd.mkdir()
        out = run_python(code, cwd, timeout=400)
        if "llm.finetune(" not in code:
            continue
        lines = dict(line.split(":", 1) for line in out.splitlines()
                     if line.startswith(("base:", "tuned:")))
        assert lines["tuned"].strip().startswith(FACT), out
        assert FACT not in lines["base"], out
        assert (cwd / "tuned" / "adapter_model.safetensors").is_file()


@pytest.mark.timeout(600)
def test_server_examples_run_against_the_default_server(smollm2_dir, tmp_path):
    code = "\n".join(code for mark, code in readme_blocks() if mark == "server")
    server = ServerProcess(["--model", smollm2_dir, "--served-model-name",
                            "smollm2-135m-instruct", "--state-dir", str(tmp_path / "state")],
                           str(tmp_path / "server.log"))
    try:
        code = code.replace("http://localhost:8000", server.url)
        out = run_python(code, tmp_path, timeout=400)
    finally:
        server.stop()
    assert out.strip().splitlines()[-1].split() == ["succeeded", FACT], out

"""flexserve.envs: every FLEXSERVE_* variable's default, parsing and errors, read at call time."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from flexserve import envs

ROOT = Path(__file__).resolve().parent.parent


def test_defaults(monkeypatch):
    for name in (envs.HOME, envs.API_KEY, envs.ITERATION_TRACE, envs.STALL_DUMP_S,
                 envs.WINDOW_ATTENTION, envs.KERNELS, envs.CUDA_EXT, envs.LORA_DECODE_BACKEND,
                 envs.LORA_PREFILL_BACKEND, envs.TRITON_INTERPRET):
        monkeypatch.delenv(name, raising=False)
    assert envs.home() == os.path.expanduser("~/.cache/flexserve")
    assert envs.api_key() is None
    assert envs.iteration_trace() is None
    assert envs.stall_dump_s() == 1.0
    assert envs.window_attention() == "cudnn-buckets"
    assert envs.kernels_backend() == "auto"
    assert envs.cuda_ext_enabled()
    assert envs.lora_decode_backend() == "auto"
    assert envs.lora_prefill_backend() == "auto"
    assert not envs.triton_interpret()


def test_values_are_read_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv(envs.HOME, str(tmp_path))
    assert envs.home() == str(tmp_path)
    envs.set_home("~/elsewhere")
    assert envs.home() == os.path.join(os.path.expanduser("~"), "elsewhere")
    monkeypatch.setenv(envs.STALL_DUMP_S, "0.25")
    assert envs.stall_dump_s() == 0.25
    monkeypatch.setenv(envs.API_KEY, "")
    assert envs.api_key() is None
    monkeypatch.setenv(envs.API_KEY, "sk-1")
    assert envs.api_key() == "sk-1"
    for value, on in (("0", False), ("off", False), ("No", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(envs.CUDA_EXT, value)
        assert envs.cuda_ext_enabled() is on
    for value, on in (("1", True), ("TRUE", True), ("0", False), ("", False)):
        monkeypatch.setenv(envs.TRITON_INTERPRET, value)
        assert envs.triton_interpret() is on


@pytest.mark.parametrize("name, read, good, bad", [
    (envs.WINDOW_ATTENTION, envs.window_attention, ("FLASH", "cudnn-buckets"), "cudnn"),
    (envs.KERNELS, envs.kernels_backend, ("torch", "AUTO"), "triton"),
    (envs.LORA_DECODE_BACKEND, envs.lora_decode_backend, ("cuda", "TRITON", "auto"), "cutlass"),
    (envs.LORA_PREFILL_BACKEND, envs.lora_prefill_backend, ("SGMV", "auto"), "fused"),
])
def test_choices_are_lowercased_and_checked(monkeypatch, name, read, good, bad):
    for value in good:
        monkeypatch.setenv(name, value)
        assert read() == value.lower()
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"{name} must be one of"):
        read()


def test_envs_is_a_leaf_module():
    tree = ast.parse((ROOT / "flexserve" / "envs.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "os"}


def test_every_variable_is_documented_once():
    table = (ROOT / "docs" / "environment.md").read_text()
    names = {v for k, v in vars(envs).items() if k.isupper() and isinstance(v, str)
             and re.fullmatch(r"(FLEXSERVE|TRITON)_[A-Z_]+", v)}
    for name in names:
        assert len(re.findall(rf"^\| `{name}` \|", table, re.M)) == 1, name


def test_no_other_module_reads_a_flexserve_variable():
    pattern = re.compile(r"environ(\.get)?\W+[\"']FLEXSERVE_|getenv\([\"']FLEXSERVE_")
    offenders = [str(path.relative_to(ROOT)) for folder in ("flexserve", "kernels")
                 for path in (ROOT / folder).rglob("*.py")
                 if path.name != "envs.py" and pattern.search(path.read_text())]
    assert offenders == []


@pytest.mark.parametrize("value, fused", [("auto", True), ("sgmv", False)])
def test_the_lora_ops_read_the_prefill_backend_once_at_import(value, fused):
    """FLEXSERVE_LORA_PREFILL_BACKEND=sgmv keeps prefill-sized batches off the fused kernels."""
    import subprocess
    import sys

    code = "import flexserve_kernels.lora.serve.ops as ops; print(ops._FUSED_PREFILL)"
    env = dict(os.environ, **{envs.LORA_PREFILL_BACKEND: value})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(fused)

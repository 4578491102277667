"""Running Triton kernels under the interpreter (TRITON_INTERPRET=1) inside a pytest session.

Triton decides at decoration time whether a kernel is interpreted, and transformers may import
Triton first, outside the interpreter. So a kernel test module imports its kernel modules through
`import_kernels` (reloading them with the interpreter on when needed); and if Triton's own library
was already decorated for compilation, the module reruns itself in a child process
(`run_module_in_child`), where everything is interpreted.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest


def import_kernels(names: tuple[str, ...], interpret: bool) -> list[ModuleType]:
    """The kernel modules, decorated for the interpreter when `interpret`."""
    previous = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        modules = []
        for name in names:
            module = sys.modules.get(name)
            if module is None:
                module = importlib.import_module(name)
            elif interpret and any(isinstance(v, triton.runtime.JITFunction) for v in vars(module).values()):
                module = importlib.reload(module)
            modules.append(module)
        return modules
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def is_interpreted(kernel: object) -> bool:
    """A kernel decorated under the interpreter is not a compiling JITFunction."""
    import triton

    return not isinstance(kernel, triton.runtime.JITFunction)


def library_is_compiled() -> bool:
    """Triton's own library was decorated for compilation: it cannot run interpreted here."""
    import triton

    return isinstance(triton.language.zeros, triton.runtime.JITFunction)


CHILD_TEST_NAME = "test_module_in_interpreter_child_process"


def run_module_in_child(path: str) -> None:
    """Run a test module with TRITON_INTERPRET=1 in a fresh interpreter; fail with its output."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                            cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def interpreter_hooks(path: str, interpreted: bool, run_in_child: bool) -> tuple[Any, Any]:
    """(the child-process test, the autouse fixture) of a kernel test module; assign them there:

        test_module_in_interpreter_child_process, _triton_interpret = interpreter_hooks(
            __file__, INTERPRETED, RUN_IN_CHILD)

    The test reruns the module in a child process when Triton's library is compiled in this one;
    the fixture then skips the module's other tests here, and otherwise keeps TRITON_INTERPRET
    set while an interpreted test launches kernels."""

    @pytest.mark.skipif(not run_in_child, reason="Triton's library is interpreted in this process")
    def test_module_in_interpreter_child_process():
        run_module_in_child(path)

    @pytest.fixture(autouse=True)
    def _triton_interpret(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
        if run_in_child and request.node.originalname != CHILD_TEST_NAME:
            pytest.skip(f"runs in {CHILD_TEST_NAME}")
        if interpreted:
            monkeypatch.setenv("TRITON_INTERPRET", "1")

    assert test_module_in_interpreter_child_process.__name__ == CHILD_TEST_NAME
    return test_module_in_interpreter_child_process, _triton_interpret


# What every `compile_for_hopper` script starts with: the sm_90 target and `check_spills`.
_HOPPER_PREAMBLE = r'''
import os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
target = GPUTarget("cuda", 90, 32)
_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

def check_spills(kernel, label):
    """Exit naming `label` when the compiled kernel spills registers to the stack (read with
    the cuobjdump Triton ships; nothing is checked without it)."""
    if not os.path.exists(_CUOBJDUMP):
        return
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"]); f.flush()
        usage = subprocess.run([_CUOBJDUMP, "-res-usage", f.name], capture_output=True,
                               text=True).stdout
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    if stack:
        sys.exit(f"{label}: {stack} bytes of spills")
'''


def compile_for_hopper(script: str) -> None:
    """Run `script` (which compiles kernels offline for sm_90 with `target` and `check_spills`
    from the preamble, and prints "ok" when none spills) in a child process without the
    interpreter; skip when Triton has no NVIDIA backend."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default; silences triton 3.9's notice
    result = subprocess.run([sys.executable, "-c", _HOPPER_PREAMBLE + script], env=env,
                            capture_output=True, text=True, timeout=300)
    output = result.stdout[-2000:] + result.stderr[-4000:]
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), output

"""Every FLEXSERVE_* environment variable: its name, default and parsing, in one place.

Each is read when its function is called (never cached at import), so `monkeypatch.setenv` and a
server's `--state-dir` take effect at once. A leaf module (it imports only the standard library)
so that the kernels can read their switches here too. docs/environment.md lists them all.
"""

from __future__ import annotations

import os

HOME = "FLEXSERVE_HOME"
API_KEY = "FLEXSERVE_API_KEY"
ADMIN_API_KEY = "FLEXSERVE_ADMIN_API_KEY"
ITERATION_TRACE = "FLEXSERVE_ITERATION_TRACE"
STALL_DUMP_S = "FLEXSERVE_STALL_DUMP_S"
WINDOW_ATTENTION = "FLEXSERVE_WINDOW_ATTENTION"
KERNELS = "FLEXSERVE_KERNELS"
CUDA_EXT = "FLEXSERVE_CUDA_EXT"
LORA_DECODE_BACKEND = "FLEXSERVE_LORA_DECODE_BACKEND"
LORA_PREFILL_BACKEND = "FLEXSERVE_LORA_PREFILL_BACKEND"
# Triton's own switch, parsed here as Triton parses it, since flexserve's dispatch depends on it.
TRITON_INTERPRET = "TRITON_INTERPRET"

DEFAULT_HOME = "~/.cache/flexserve"
DEFAULT_STALL_DUMP_S = 1.0
WINDOW_ATTENTION_MODES = ("flash", "cudnn-buckets")
DEFAULT_WINDOW_ATTENTION = "cudnn-buckets"
KERNELS_BACKENDS = ("auto", "torch")
DEFAULT_KERNELS = "auto"
LORA_DECODE_BACKENDS = ("auto", "cuda", "triton")
DEFAULT_LORA_DECODE_BACKEND = "auto"
LORA_PREFILL_BACKENDS = ("auto", "sgmv")
DEFAULT_LORA_PREFILL_BACKEND = "auto"

_TRUE = ("1", "true", "on", "yes", "y")
_FALSE = ("0", "false", "off", "no")


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, default).lower()
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def home() -> str:
    """FLEXSERVE_HOME, user-expanded: converted models, latency profiles, jobs, built extensions."""
    return os.path.expanduser(os.environ.get(HOME, DEFAULT_HOME))


def set_home(path: str) -> None:
    """Point FLEXSERVE_HOME at `path` (absolute) for this process and its children."""
    os.environ[HOME] = os.path.abspath(os.path.expanduser(path))


def api_key() -> str | None:
    """FLEXSERVE_API_KEY: the key `flexserve serve` requires, and `flexserve bench serve` sends."""
    return os.environ.get(API_KEY) or None


def admin_api_key() -> str | None:
    """FLEXSERVE_ADMIN_API_KEY: an operator key of `flexserve serve` (--admin-api-key)."""
    return os.environ.get(ADMIN_API_KEY) or None


def iteration_trace() -> str | None:
    """FLEXSERVE_ITERATION_TRACE: the file the engine appends iteration lines to; None: off."""
    return os.environ.get(ITERATION_TRACE) or None


def stall_dump_s() -> float:
    """FLEXSERVE_STALL_DUMP_S: seconds a step may run before its thread stacks are traced."""
    return float(os.environ.get(STALL_DUMP_S, str(DEFAULT_STALL_DUMP_S)))


def window_attention() -> str:
    """FLEXSERVE_WINDOW_ATTENTION: what a whole-prefix backward window runs on CUDA."""
    return _choice(WINDOW_ATTENTION, DEFAULT_WINDOW_ATTENTION, WINDOW_ATTENTION_MODES)


def kernels_backend() -> str:
    """FLEXSERVE_KERNELS: auto (Triton on CUDA) or torch (the references everywhere)."""
    return _choice(KERNELS, DEFAULT_KERNELS, KERNELS_BACKENDS)


def triton_interpret() -> bool:
    """TRITON_INTERPRET asks for Triton's CPU interpreter (parsed as Triton does)."""
    return os.environ.get(TRITON_INTERPRET, "0").lower() in _TRUE


def cuda_ext_enabled() -> bool:
    """FLEXSERVE_CUDA_EXT: anything but 0/false/off/no leaves the CUDA BGMV extension on."""
    return os.environ.get(CUDA_EXT, "1").lower() not in _FALSE


def lora_decode_backend() -> str:
    """FLEXSERVE_LORA_DECODE_BACKEND: which kernels run LoRA in decode (auto, cuda or triton)."""
    return _choice(LORA_DECODE_BACKEND, DEFAULT_LORA_DECODE_BACKEND, LORA_DECODE_BACKENDS)


def lora_prefill_backend() -> str:
    """FLEXSERVE_LORA_PREFILL_BACKEND: which kernels run LoRA in prefill-sized batches: auto
    (LoRAFusion's fused kernels where `flexserve_kernels.lora.serve.ops.fuses_batch` takes the
    batch) or sgmv (the SGMV shrink and expand around the frozen GEMM). Read once per process."""
    return _choice(LORA_PREFILL_BACKEND, DEFAULT_LORA_PREFILL_BACKEND, LORA_PREFILL_BACKENDS)

"""Which implementation a layer runs: the Triton kernels or the torch references.

Triton on CUDA (unless FLEXSERVE_KERNELS=torch asks for the torch path, e.g. to compare the two on
one GPU); on CPU only when TRITON_INTERPRET=1 asks for Triton's interpreter (the tests), since a
CPU server must work without a compiler. Read at call time, so a test can switch per process.
"""

from __future__ import annotations

import os

import torch

_BACKENDS = ("auto", "torch")


def interpret_requested() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's CPU interpreter (parsed as Triton does)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")


def kernels_backend() -> str:
    """FLEXSERVE_KERNELS: auto (default) or torch; ValueError for anything else."""
    backend = os.environ.get("FLEXSERVE_KERNELS", "auto").lower()
    if backend not in _BACKENDS:
        raise ValueError(f"FLEXSERVE_KERNELS must be one of {_BACKENDS}, got {backend!r}")
    return backend


def use_triton(device: torch.device | str) -> bool:
    """Whether layers on `device` run the Triton kernels."""
    device = torch.device(device)
    if kernels_backend() == "torch":
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpret_requested()

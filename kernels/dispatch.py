"""Which implementation a layer runs: the Triton kernels or the torch references.

Triton on CUDA (unless FLEXSERVE_KERNELS=torch asks for the torch path); on CPU only when
TRITON_INTERPRET=1 asks for Triton's interpreter (the tests), since a CPU server must work without
a compiler. The variables' names and parsing live in `flexserve.envs`. Read at call time, so a
test can switch per process (`monkeypatch.setenv`, `os.environ[...] = ...`): `use_triton` caches its answer per (device,
TRITON_INTERPRET, FLEXSERVE_KERNELS) and looks the two variables up on every call, in the mapping
`os.environ` itself reads and writes, without its per-lookup str encoding and decoding (a step
with a fine-tuning window asks ~600 times on a 32-layer model: 2.8 us per call read through
`os.environ.get`, 0.2 us this way, on this repository's 2-core CPU box).
"""

from __future__ import annotations

import os

import torch

from flexserve import envs

_INTERPRET = envs.TRITON_INTERPRET
_BACKEND = envs.KERNELS
# os.environ's backing dict (encoded keys and values): every os.environ write, monkeypatch's
# included, goes through it, so reading it sees what os.environ.get would. Without it (another
# Python), the public mapping is read.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS = ((os.environ.encodekey(_INTERPRET), os.environ.encodekey(_BACKEND))
             if _ENV_DATA is not None and hasattr(os.environ, "encodekey") else None)
_MAX_CACHED = 64
_cache: dict[tuple, bool] = {}


def use_triton(device: torch.device | str) -> bool:
    """Whether layers on `device` run the Triton kernels."""
    if _ENV_KEYS is not None:
        key = (device, _ENV_DATA.get(_ENV_KEYS[0]), _ENV_DATA.get(_ENV_KEYS[1]))
    else:
        key = (device, os.environ.get(_INTERPRET), os.environ.get(_BACKEND))
    answer = _cache.get(key)
    if answer is None:
        answer = _use_triton(device)  # raises (and caches nothing) for a bad FLEXSERVE_KERNELS
        if len(_cache) >= _MAX_CACHED:
            _cache.clear()
        _cache[key] = answer
    return answer


def _use_triton(device: torch.device | str) -> bool:
    device = torch.device(device)
    if envs.kernels_backend() == "torch":
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and envs.triton_interpret()

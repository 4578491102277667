"""Tuned launch settings of the Triton kernels, read from per-GPU JSON files beside them.

A kernel folder keeps a `configs/` directory of `<GPU name>.json` files (torch's device name with
spaces as underscores, e.g. `NVIDIA_H100_80GB_HBM3.json`) and a `default.json` that unknown GPUs
and the CPU (Triton's interpreter) get. Each file maps an operation name to its settings; each
folder's `configs/README.md` says which benchmark measures them and how to regenerate a file.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

DEFAULT_FILE = "default.json"
# Settings the kernels take as tile sizes or warp counts: powers of two.
POWER_OF_TWO_KEYS = frozenset({"block_m", "block_n", "block_k", "num_warps", "epilogue_split"})
# Settings that are switches rather than counts.
BOOL_KEYS = frozenset({"key_table", "warp_specialize"})


def config_file_name(device_name: str | None) -> str:
    """The file a device's settings live in: its name with spaces as underscores, or default.json
    for the CPU (device_name None)."""
    return DEFAULT_FILE if device_name is None else device_name.replace(" ", "_") + ".json"


@functools.cache
def _cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device | str | None = None) -> str | None:
    """torch's name of a CUDA device (the current one by default; cached per index), None for the
    CPU or where CUDA is unavailable."""
    if device is None:
        if not torch.cuda.is_available():
            return None
        return _cuda_device_name(torch.cuda.current_device())
    if isinstance(device, str):
        device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_device_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def load_configs(configs_dir: str, device_name: str | None) -> dict:
    """The validated settings of `device_name` in configs_dir: its own file where there is one,
    else default.json. ValueError naming the file for a malformed one (every file carries the
    operations default.json carries)."""
    folder = Path(configs_dir)
    default = _read(folder / DEFAULT_FILE)
    path = folder / config_file_name(device_name)
    if not path.is_file():
        return default
    configs = _read(path)
    missing = sorted(set(default) - set(configs))
    if missing:
        raise ValueError(f"{path}: missing operations {missing} (default.json has them)")
    return configs


def _read(path: Path) -> dict:
    try:
        configs = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(configs, dict) or not configs:
        raise ValueError(f"{path}: expected an object of operations")
    for op, settings in configs.items():
        _check(path, op, settings)
    return configs


def _check(path: Path, where: str, value, key: str | None = None) -> None:
    """Every leaf an int >= 1 (a power of two under POWER_OF_TWO_KEYS) or, under BOOL_KEYS, a bool;
    objects keyed by rank (`by_rank`) have integer keys, by shape (`by_shape`) keys like "6144x4096"."""
    if isinstance(value, dict):
        if not value:
            raise ValueError(f"{path}: {where} is empty")
        for k, v in value.items():
            if key == "by_rank" and not k.isdigit():
                raise ValueError(f"{path}: {where} has rank key {k!r}, not an integer")
            if key == "by_shape" and not all(part.isdigit() for part in k.split("x")):
                raise ValueError(f"{path}: {where} has shape key {k!r}, not sizes joined by 'x'")
            _check(path, f"{where}.{k}", v, k)
    elif isinstance(value, list):
        if not value:
            raise ValueError(f"{path}: {where} is empty")
        for i, v in enumerate(value):
            _check(path, f"{where}[{i}]", v, key)
    elif key in BOOL_KEYS:
        if not isinstance(value, bool):
            raise ValueError(f"{path}: {where} must be true or false, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path}: {where} must be a positive integer, got {value!r}")
    elif key in POWER_OF_TWO_KEYS and value & (value - 1):
        raise ValueError(f"{path}: {where} must be a power of two, got {value}")


def by_rank(table: dict, max_rank: int) -> dict:
    """The entry of a `by_rank` table for max_rank: the one with the smallest rank key >= max_rank
    (each key is the largest rank its entry serves)."""
    for rank in sorted(table, key=int):
        if max_rank <= int(rank):
            return table[rank]
    raise ValueError(f"no tuned settings for rank {max_rank} (largest: {max(map(int, table))})")

"""Tuned launch settings of the kernels in kernels/ itself (gemv.py), one JSON file per GPU
(README.md); the kernel folders keep their own configs/ beside their kernels."""

from __future__ import annotations

from pathlib import Path

import torch

from flexserve_kernels.tuned_configs import device_name, load_configs

CONFIGS_DIR = str(Path(__file__).resolve().parent)


def kernel_configs(device: torch.device | str | None = None) -> dict:
    """The settings for `device` (the current CUDA device by default): its GPU's file, else
    default.json (unknown GPUs and the CPU)."""
    return load_configs(CONFIGS_DIR, device_name(device))

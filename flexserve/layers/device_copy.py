"""Small host-side index and parameter data to the device without a host sync."""

from __future__ import annotations

import torch


def to_device(values: list | torch.Tensor, device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list or CPU tensor on `device`. On CUDA it goes through pinned memory with a
    non-blocking copy, so preparing a step's inputs never waits for the GPU (a pageable copy
    would synchronize the stream and serialize host work after the forward)."""
    device = torch.device(device)
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None:
        t = t.to(dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)

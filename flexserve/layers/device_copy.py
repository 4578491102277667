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


class HostCopy:
    """A device tensor on its way to the host. On CUDA the copy goes into pinned memory behind
    the work queued so far, and `tolist` waits for that copy alone, not for work queued after
    it (a step launched ahead, asynchronous scheduling); elsewhere it is readable at once."""

    def __init__(self, t: torch.Tensor) -> None:
        self._event = None
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            t = host
        self._host = t

    def tolist(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()

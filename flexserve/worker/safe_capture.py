"""Capturing a CUDA graph while the server runs, without breaking on other threads' work.

Graphs are captured while the server serves (mixed-iteration buckets met for the first time, a
fine-tuning job's backward windows when it starts), while other threads keep using CUDA: an
adapter load pins host memory, for one. torch's default capture mode ("global") forbids such
calls in every thread during a capture, so one of them fails both itself and the capture. The
captures here use "thread_local" mode (only the capturing thread is restricted), as a capture
that other threads cannot see must.

A capture that fails anyway (out of memory, a kernel that cannot be captured) leaves torch's
allocator routing the capture stream's allocations to the graph's memory pool, and torch refuses
any later capture into that pool: `capture` ends the routing before it raises `CaptureFailed`,
and the caller runs the work eagerly and captures later graphs into a new pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class CaptureFailed(RuntimeError):
    """A CUDA graph capture failed; the graph is unusable and the work must run eagerly."""


def capture(graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None, fn: Callable[[], T],
            device: torch.device) -> T:
    """Capture `fn()` into `graph` (allocating from `pool`, or a new pool when None) and return
    what it returned; `CaptureFailed` with the reason when the capture fails."""
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            return fn()
    except RuntimeError as e:
        _end_routing(graph, pool, device)
        raise CaptureFailed(f"CUDA graph capture failed: {e}") from e


def _end_routing(graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None,
                 device: torch.device) -> None:
    """Stop the allocator from sending allocations to the failed capture's pool (torch ends the
    routing only when the capture itself ends cleanly)."""
    pool_id = pool
    if pool_id is None:
        try:
            pool_id = graph.pool()
        except RuntimeError:
            return  # the capture never began: nothing is routed
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(index, pool_id)
    except RuntimeError:
        pass  # torch had ended it already

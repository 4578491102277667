"""CUDA graphs captured while the server runs: other threads' CUDA calls do not break them, and after a
failed capture the next one works (`flexserve/worker/safe_capture.py`). GPU only."""

import threading

import pytest
import torch

from flexserve.worker.safe_capture import CaptureFailed, capture

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


def test_capture_survives_pinning_in_another_thread():
    x = torch.zeros(1024, device=CUDA)
    y = x * 2 + 1  # warm-up: the kernels exist before the capture
    torch.cuda.synchronize()
    inside, pinned = threading.Event(), threading.Event()

    def pin() -> None:  # what an adapter load does on a server thread
        inside.wait(10)
        torch.empty(1 << 20).pin_memory()
        pinned.set()

    def body() -> torch.Tensor:
        inside.set()
        assert pinned.wait(10)
        return x * 2 + 1

    thread = threading.Thread(target=pin)
    thread.start()
    graph = torch.cuda.CUDAGraph()
    y = capture(graph, torch.cuda.graph_pool_handle(), body, CUDA)
    thread.join()
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 7.0))


def test_after_a_failed_capture_a_new_pool_captures():
    x = torch.ones(256, device=CUDA)
    (x + 1).sum().item()
    with pytest.raises(CaptureFailed):
        capture(torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle(),
                lambda: (x + 1).sum().item(), CUDA)
    graph = torch.cuda.CUDAGraph()
    y = capture(graph, torch.cuda.graph_pool_handle(), lambda: x + 1, CUDA)
    z = torch.zeros_like(x)  # allocated outside any capture: not from a graph's pool
    x.fill_(4.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 5.0)) and torch.equal(z, torch.zeros_like(x))

"""The one-shot all-reduce of small tensors among the GPUs of one host, over their peer links.

A decode step at N ranks all-reduces 2 x num_layers activations of a few KB each (after o_proj
and down_proj). NCCL's all-reduce spends several microseconds of latency on each however small
it is; a one-shot all-reduce (vLLM's custom all-reduce does the same) is one kernel: each rank
copies its tensor into its buffer in symmetric memory, waits at a barrier until every rank has,
reads every rank's buffer over NVLink and sums them, and waits at a second barrier so that no
buffer is written again while a peer still reads it. Here it is PyTorch's
`symm_mem.one_shot_all_reduce_copy_out` on a buffer allocated once per group.

It serves sums of contiguous bfloat16/float32 tensors up to `ONE_SHOT_MAX_BYTES`; larger ones
(prefill chunks, fine-tuning windows) and other reductions stay on NCCL, whose bandwidth wins
there. Its buffer is one per group: only one stream may use it at a time, so work on a second
stream all-reduces through NCCL (`TensorParallelGroup.nccl_only`). Used only where every rank of
the group is on one host and each pair of its GPUs has peer access; `--disable-custom-all-reduce`
turns it off.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# The crossover with NCCL's ring on two H200s (benchmarks/allreduce.py, docs/benchmarks.md):
# a decode step's all-reduces (1 to 256 rows of 4096-8192 bf16) are all below it.
ONE_SHOT_MAX_BYTES = 4 * 1024 * 1024
_DTYPES = (torch.bfloat16, torch.float32)


def one_shot_eligible(x: torch.Tensor, max_bytes: int = ONE_SHOT_MAX_BYTES) -> bool:
    """Whether the one-shot all-reduce can sum `x`: contiguous bfloat16 or float32 of at most
    `max_bytes`, a multiple of 4 bytes (the kernel's narrowest access)."""
    nbytes = x.numel() * x.element_size()
    return (x.dtype in _DTYPES and x.is_contiguous() and 0 < nbytes <= max_bytes
            and nbytes % 4 == 0)


def _group_name(group: Any) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def peers_reachable(group: Any) -> bool:
    """Whether every rank of `group` (a process group over NCCL) is on this host and each of its
    GPUs can access each other's memory; the same answer on every rank (collective)."""
    device = torch.cuda.current_device()
    local = (socket.gethostname(), device)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, local, group=group)
    same_host = all(host == local[0] for host, _ in everyone)
    reach = same_host and all(peer == device or torch.cuda.can_device_access_peer(device, peer)
                              for _, peer in everyone)
    verdicts: list[Any] = [None] * len(everyone)
    dist.all_gather_object(verdicts, reach, group=group)
    return all(verdicts)


class OneShotAllReduce:
    """The one-shot all-reduce of this process's tensor-parallel `group` (over NCCL, CUDA);
    made on every rank of the group together (its buffer is allocated collectively)."""

    def __init__(self, group: Any, max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        # This all-reduce loads peers' buffers directly; it needs no multicast object, whose
        # creation some hosts forbid.
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = _group_name(group)
        self.max_bytes = max_bytes
        device = torch.device("cuda", torch.cuda.current_device())
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (`one_shot_eligible`), as a new tensor."""
        staged = self.buffer[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name, out)
        return out


def make_one_shot_all_reduce(group: Any) -> OneShotAllReduce | None:
    """The group's one-shot all-reduce where its ranks can use one (same host, peer access,
    PyTorch with the operation), else None: every all-reduce goes through NCCL. Collective."""
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        logger.info("one-shot all-reduce off: this PyTorch has no symm_mem."
                    "one_shot_all_reduce_copy_out; all-reduces go through NCCL")
        return None
    if not peers_reachable(group):
        logger.info("one-shot all-reduce off: the ranks are not all on one host with peer "
                    "access between their GPUs; all-reduces go through NCCL")
        return None
    reducer = OneShotAllReduce(group)
    logger.info("one-shot all-reduce on for sums up to %d KiB (larger ones through NCCL)",
                reducer.max_bytes // 1024)
    return reducer

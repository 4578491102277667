"""The tensor-parallel group: this process's rank, the world size and the collectives the
sharded layers need (all-reduce of row-parallel outputs, all-gather of vocab-parallel logits).

One group per process, set by `init_tensor_parallel` in each worker before it builds its model
(vLLM's `parallel_state` holds it the same way). Until then, and always at world size 1, the
group is the single-process one: its collectives return their input and no process group exists.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TensorParallelGroup:
    """A rank of a tensor-parallel group; world size 1 without torch.distributed."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.rank = rank
        self.world_size = world_size

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The sum (op "sum"), maximum ("max") or minimum ("min") of every rank's `x`, in
        place."""
        if self.world_size > 1:
            dist.all_reduce(x, op=_REDUCE_OPS[op])
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` (equal shapes) concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the engine sizes the KV cache from it)."""
        if self.world_size == 1:
            return value
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


_group = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    """This process's tensor-parallel group (world size 1 unless `init_tensor_parallel` ran)."""
    return _group


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str,
                         timeout_s: float = 600.0) -> TensorParallelGroup:
    """Join the world of `world_size` ranks at `init_method` (`tcp://host:port`) and make it this
    process's group. `backend`: gloo (CPU) or nccl (CUDA). World size 1 starts no process group."""
    global _group
    if world_size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        logger.info("tensor-parallel rank %d of %d joined (%s)", rank, world_size, backend)
    _group = TensorParallelGroup(rank, world_size)
    return _group


def destroy_tensor_parallel() -> None:
    """Leave the process group; the group is the single-process one again."""
    global _group
    if _group.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _group = TensorParallelGroup()

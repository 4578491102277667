"""The model-parallel groups of this process: its tensor-parallel group (its rank, the group's
size and the collectives the sharded layers need: all-reduce of row-parallel outputs,
all-gather of vocab-parallel logits) and its pipeline stage (which layers it holds, and the
point-to-point transfers of hidden states between stages).

Ranks are numbered stage by stage: global rank = stage x tensor_parallel_size + tp rank. Each
stage's ranks form one tensor-parallel group; rank r of a stage sends to rank r of the next.
Set by `init_model_parallel` in each worker before it builds its model (vLLM's
`parallel_state` holds them the same way). Until then, and always for one process, the groups
are the single-process ones: collectives return their input and no process group exists.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from flexserve.distributed.one_shot_all_reduce import make_one_shot_all_reduce, one_shot_eligible

logger = logging.getLogger(__name__)

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TensorParallelGroup:
    """A rank of a tensor-parallel group; world size 1 without torch.distributed. `group`: the
    torch.distributed group of its ranks (None: the whole world)."""

    def __init__(self, rank: int = 0, world_size: int = 1, group: Any = None,
                 one_shot: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        # The one-shot all-reduce of small sums (one_shot_all_reduce.py); None: NCCL/gloo only.
        self.one_shot = one_shot
        self._nccl_only = 0

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The sum (op "sum"), maximum ("max") or minimum ("min") of every rank's `x`: `x`
        itself, reduced in place, or a new tensor (a small sum on the one-shot all-reduce, or
        a non-contiguous `x`: a merged projection's column slice)."""
        if self.world_size > 1:
            x = x.contiguous()  # NCCL, gloo and the one-shot kernel take dense tensors
            if (op == "sum" and self.one_shot is not None and not self._nccl_only
                    and one_shot_eligible(x)):
                return self.one_shot(x)
            dist.all_reduce(x, op=_REDUCE_OPS[op], group=self.group)
        return x

    @contextlib.contextmanager
    def nccl_only(self) -> Iterator[None]:
        """All-reduces launched inside go through NCCL: for work on a second CUDA stream, which
        must not share the one-shot all-reduce's buffer with the first."""
        self._nccl_only += 1
        try:
            yield
        finally:
            self._nccl_only -= 1

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` (equal shapes) concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


def world_min(value: int) -> int:
    """The smallest of every process's `value`, over the whole world (every stage's every rank:
    the engine sizes its one KV-cache block pool from it); `value` for one process."""
    if not dist.is_initialized():
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class PipelineStage:
    """This process's pipeline stage: `stage` of `num_stages`, holding decoder layers
    [first_layer, end_layer); hidden states go to the same tensor-parallel rank of the next
    stage (global rank + `stride`)."""

    def __init__(self, stage: int = 0, num_stages: int = 1, global_rank: int = 0,
                 stride: int = 1) -> None:
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} is outside {num_stages} stages")
        self.stage, self.num_stages = stage, num_stages
        self.global_rank, self.stride = global_rank, stride

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """The decoder layers of this stage: contiguous, the first stages one more when they do
        not divide evenly."""
        return pipeline_layers(num_layers, self.num_stages, self.stage)

    def send_next(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """Send `tensors` to the next stage (which knows their shapes from the plan)."""
        for t in tensors:
            dist.send(t.contiguous(), self.global_rank + self.stride)

    def recv_previous(self, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, ...]:
        """Receive tensors of these shapes from the previous stage."""
        out = []
        for shape in shapes:
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, self.global_rank - self.stride)
            out.append(t)
        return tuple(out)


def pipeline_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """Layers [first, end) of `stage` when `num_stages` split `num_layers` contiguously, the
    first `num_layers % num_stages` stages taking one more."""
    base, extra = divmod(num_layers, num_stages)
    first = stage * base + min(stage, extra)
    return first, first + base + (1 if stage < extra else 0)


_group = TensorParallelGroup()
_stage = PipelineStage()


def get_tp_group() -> TensorParallelGroup:
    """This process's tensor-parallel group (world size 1 unless `init_tensor_parallel` ran)."""
    return _group


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now ("": every interface), for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def get_pp_stage() -> PipelineStage:
    """This process's pipeline stage (the only one unless `init_model_parallel` made more)."""
    return _stage


def init_model_parallel(rank: int, tensor_parallel_size: int, pipeline_parallel_size: int,
                        init_method: str, backend: str, timeout_s: float = 600.0,
                        custom_all_reduce: bool = True) -> TensorParallelGroup:
    """Join the world of tensor_parallel_size x pipeline_parallel_size processes at
    `init_method` (`tcp://host:port`) as global `rank`, and make this process's tensor-parallel
    group (its stage's ranks) and pipeline stage. `backend`: gloo (CPU) or nccl (CUDA). One
    process starts no process group. `custom_all_reduce`: on NCCL, small sums take the one-shot
    all-reduce where the group's GPUs reach each other (one_shot_all_reduce.py)."""
    global _group, _stage
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    world_size = tp * pp
    group = None
    if world_size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        if pp > 1:  # every process creates every stage's group, in the same order
            for stage in range(pp):
                ranks = list(range(stage * tp, (stage + 1) * tp))
                created = dist.new_group(ranks)
                if rank in ranks:
                    group = created
        logger.info("rank %d of %d joined (%s): tensor-parallel rank %d of %d, pipeline "
                    "stage %d of %d", rank, world_size, backend, rank % tp, tp, rank // tp, pp)
    one_shot = None
    if tp > 1 and backend == "nccl" and custom_all_reduce:
        one_shot = make_one_shot_all_reduce(group)
    _group = TensorParallelGroup(rank % tp, tp, group, one_shot)
    _stage = PipelineStage(rank // tp, pp, rank, tp)
    return _group


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str,
                         timeout_s: float = 600.0,
                         custom_all_reduce: bool = True) -> TensorParallelGroup:
    """`init_model_parallel` with one pipeline stage."""
    return init_model_parallel(rank, world_size, 1, init_method, backend, timeout_s,
                               custom_all_reduce)


def destroy_tensor_parallel() -> None:
    """Leave the process group; the groups are the single-process ones again."""
    global _group, _stage
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TensorParallelGroup()
    _stage = PipelineStage()

"""A fine-tuning job's adapter over the ranks of a tensor-parallel group (FlexLLM 5.1's dependent
parallelization of the PEFT graph, with S-LoRA's split of the adapter).

Each rank trains its part of every LoRA tensor (`TensorParallelLayout.lora_shard`): A whole and
B by output rows on column-parallel projections, A by input columns and B whole on row-parallel
ones. Its optimizer holds masters, gradients and AdamW moments of that part only, so the job's
optimizer state is sharded like its parameters.

An entry that several ranks hold (a whole A or B, or the k/v B rows of a key/value head that
ranks share) gets a partial gradient on each of them: the share of the rank's own heads,
features or input columns. `reduce_grads` sums those over their holders before a step (one
all-reduce for the job), after which every holder has the same gradient and takes the same
AdamW update. `total_norm` is the norm of the whole adapter's gradient (each shared entry
counted once), so clipping scales every rank's part alike. `gather` rebuilds whole tensors
(masters, moments) for checkpoints, which stay ordinary PEFT adapters whatever the number of
ranks, and `shard` cuts whole tensors (a starting adapter, a checkpoint to resume) into this
rank's parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from flexserve.model.tp_layout import TensorParallelLayout


class ShardedAdapter:
    """`params`: PEFT tensor name -> (target projection, "A" or "B", whole shape)."""

    def __init__(self, layout: TensorParallelLayout, tp: Any,
                 params: Mapping[str, tuple[str, str, tuple[int, int]]]) -> None:
        self.layout, self.tp = layout, tp
        self.params = dict(params)

    def _index(self, name: str) -> tuple[slice, ...] | None:
        target, half, _ = self.params[name]
        return self.layout.lora_index(target, half)

    def _copies(self, name: str) -> int:
        target, half, _ = self.params[name]
        return self.layout.lora_copies(target, half)

    def shard(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of tensor `name` (or of a tensor shaped like it: its moments)."""
        index = self._index(name)
        return whole if index is None else whole[index].clone()

    def reduce_grads(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Sum the partial gradients of shared entries over their holders, in place."""
        world = self.tp.world_size
        pieces: list[tuple[str, torch.Tensor]] = []
        for name in sorted(grads):
            copies = self._copies(name)
            if copies == world:
                pieces.append((name, grads[name]))
            elif copies > 1:  # shared by some ranks: summed in a zero-padded whole tensor
                pieces.append((name, self._placed(name, grads[name], owner_only=False)))
        for (name, tensor), reduced in zip(pieces, self._all_reduce([t for _, t in pieces])):
            grads[name].copy_(reduced if tensor is grads[name] else reduced[self._index(name)])

    def total_norm(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The L2 norm of the whole adapter's gradient (after `reduce_grads`), on every rank."""
        squares = [grads[name].float().square().sum() / self._copies(name)
                   for name in sorted(grads)]
        total = self.tp.all_reduce(torch.stack(squares).sum().reshape(1))
        return total.sqrt()[0]

    def gather(self, tensors: Mapping[str, tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Whole tensors on every rank from this rank's parts: key -> (the parameter it is
        shaped like, its part here); one all-reduce for them all."""
        keys = sorted(tensors)
        placed = [self._placed(tensors[k][0], tensors[k][1], owner_only=True) for k in keys]
        return dict(zip(keys, self._all_reduce(placed)))

    def _all_reduce(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's sum of each tensor, in one all-reduce of them all laid end to end."""
        if not tensors:
            return []
        flat = self.tp.all_reduce(torch.cat([t.reshape(-1) for t in tensors]))
        return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]),
                                                      tensors)]

    def _placed(self, name: str, part: torch.Tensor, owner_only: bool) -> torch.Tensor:
        """A zero whole tensor with `part` at this rank's place (zero everywhere when
        `owner_only` and another rank is the part's first holder)."""
        target, half, shape = self.params[name]
        whole = torch.zeros(shape, dtype=part.dtype, device=part.device)
        if owner_only and not self.layout.lora_owner(target, half):
            return whole
        index = self._index(name)
        if index is None:
            whole.copy_(part)
        else:
            whole[index] = part
        return whole

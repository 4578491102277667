"""The fine-tuning capture of a mixed iteration under a CUDA graph.

`FinetuneCapture` (activation_store.py) copies each window's rows into its store with Python
slicing, so what it launches depends on the step's windows. This capture launches the same work
whatever the windows: for each tensor the plan keeps, one `copy_rows` of the flat batch's
fine-tuning rows (`src`, a static index) into the activation arena (`dest`: the sequences'
rows plus position) for the first `count` entries. The indices cover the whole token bucket, so
one graph serves any windows of the same plan.

Supported: stores allocated from one `ActivationArena`, one kept-tensor set for every window (one
job, or jobs with one plan), no LoRA dropout, nothing kept as a bitmask or as `{target}_delta`
(`FinetuneRunner.graph_kept` checks); other steps run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flexserve.worker.finetune.activation_arena import ActivationArena
from flexserve_kernels.lora.serve.ops import lora_shrink, lora_shrink_fused

# Names a graph capture cannot keep: they need per-window work (dropout, per-slot deltas).
UNSUPPORTED_SUFFIXES = ("_delta", "_xd", "_mask")


@dataclass(frozen=True, slots=True)
class KeptTensor:
    """One tensor of one layer that the step's plan keeps, with its arena row layout."""

    width: int  # row width in the store
    dtype: torch.dtype  # element dtype in the store


class GraphCapture:
    """The forward context's `finetune` of a graph-captured mixed iteration."""

    def __init__(self, arena: ActivationArena, kept: dict[tuple[int, str], KeptTensor],
                 src: torch.Tensor, dest: torch.Tensor, count: torch.Tensor) -> None:
        self.arena = arena
        self.kept = kept  # (layer, name) -> layout, of every window's store (one plan)
        self.src = src  # [T_bucket] int64: flat row of each fine-tuning token, padding 0
        self.dest = dest  # [T_bucket] int64: its arena row, padding the dump row
        self.count = count  # [1] int32: fine-tuning tokens this replay (rows past it: none)
        self._final: torch.Tensor | None = None
        self.windows: list[tuple[int, int]] = []  # this replay's (flat start, tokens) per window

    def wants(self, layer: int, name: str) -> bool:
        return (layer, name) in self.kept

    def take(self, layer: int, name: str, tensor: torch.Tensor) -> None:
        spec = self.kept.get((layer, name))
        if spec is None:
            return
        # Imported here: only mixed-iteration graphs (CUDA) capture, and a CPU server runs
        # without Triton. A capture runs this once per kept tensor; replays run no Python.
        from flexserve_kernels.row_copy import copy_rows

        target = self.arena.tensor(layer, name, spec.width, spec.dtype)
        copy_rows(target, self.dest, tensor, self.src, self.count)

    def lora_shrink(self, module: Any, x: torch.Tensor, meta: Any, fused: bool = False) -> torch.Tensor:
        return (lora_shrink_fused if fused else lora_shrink)(x, module.lora_a, meta)

    def lora_input(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    def take_lora_shrink(self, module: Any, s: torch.Tensor) -> None:
        self.take(module.layer_idx, f"{module.target}_s", s)

    def take_final(self, stream: torch.Tensor) -> None:
        self._final = stream

    def final_stream(self, index: int) -> torch.Tensor:
        """Window `index`'s rows of the last layer's output (pre-norm), after a replay."""
        if self._final is None:
            raise RuntimeError("the forward has not been captured yet")
        start, num_tokens = self.windows[index]
        return self._final[start:start + num_tokens]

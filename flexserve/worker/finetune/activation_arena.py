"""Fine-tuning activation memory reserved once, so CUDA graphs can write into it (FlexLLM
appendix D).

A captured graph bakes in every pointer it touches, so the activation stores that a mixed
iteration's graph writes cannot be fresh allocations per sequence. The arena holds one tensor per
(layer, tensor name) of `num_rows + 1` rows; a sequence takes a row range [base, base + n) in all
of them at once, and its `ActivationStore` buffers are views of that range. The last row is the
dump row: padding entries of a graph's index writes land there. Row ranges are first-fit; a
sequence that finds no room gets private buffers and its windows run eagerly.

The tensors outlive the jobs whose plans asked for them: when the last job ends they stay, with
the graphs that write them, so the next job with the same plan starts without capturing any
(capturing a plan's mixed-iteration graphs took 20-22 s of an 8B model's start on an H200). A job
that starts alone with another plan clears them first (`holds_exactly`), dropping those graphs.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class ActivationArena:
    """Activation buffers in row ranges, shared by every fine-tuning sequence of a worker."""

    def __init__(self, num_rows: int, device: torch.device) -> None:
        if num_rows < 1:
            raise ValueError(f"an arena needs at least one row, got {num_rows}")
        self.num_rows = num_rows
        self.device = device
        self._tensors: dict[tuple[int, str], torch.Tensor] = {}
        self._ranges: dict[int, int] = {}  # base row -> rows, of ranges in use

    @property
    def dump_row(self) -> int:
        """The row that padding entries of a graph's index writes point at."""
        return self.num_rows

    @property
    def num_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    def allocate(self, num_rows: int) -> int | None:
        """The first free range of `num_rows` rows (its base), or None when none is free."""
        position = 0
        for base in sorted(self._ranges):
            if base - position >= num_rows:
                break
            position = max(position, base + self._ranges[base])
        if position + num_rows > self.num_rows:
            return None
        self._ranges[position] = num_rows
        return position

    def release(self, base: int) -> None:
        self._ranges.pop(base, None)

    def tensor(self, layer: int, name: str, width: int, dtype: torch.dtype) -> torch.Tensor:
        """The [num_rows + 1, width] tensor of (layer, name), allocated on first use; ValueError
        when an earlier user gave it another width or dtype."""
        key = (layer, name)
        t = self._tensors.get(key)
        if t is None:
            # Zeros: every row holds finite values, so a captured backward's padding rows,
            # which read some row and multiply it by a zero gradient, add exactly nothing.
            t = torch.zeros((self.num_rows + 1, width), dtype=dtype, device=self.device)
            self._tensors[key] = t
        elif t.shape[1] != width or t.dtype != dtype:
            raise ValueError(f"arena tensor {key} is [{t.shape[1]}] {t.dtype}, asked for "
                             f"[{width}] {dtype}")
        return t

    def clear(self) -> None:
        """Free every tensor (no sequence may hold rows; graphs that wrote them must go)."""
        if self._ranges:
            raise RuntimeError(f"{len(self._ranges)} sequences still hold arena rows")
        self._tensors.clear()

    def holds_exactly(self, layout: list[tuple[int, str, int, torch.dtype]]) -> bool:
        """Whether the arena's tensors are exactly those of this (layer, name, width, dtype)
        layout."""
        return len(layout) == len(self._tensors) and all(self.holds(*entry) for entry in layout)

    def get(self, layer: int, name: str) -> torch.Tensor:
        """The whole [num_rows + 1, width] tensor of (layer, name) (KeyError when missing)."""
        return self._tensors[(layer, name)]

    def has(self, layer: int, name: str) -> bool:
        return (layer, name) in self._tensors

    def holds(self, layer: int, name: str, width: int, dtype: torch.dtype) -> bool:
        """Whether the arena has the tensor of (layer, name) with this row width and dtype."""
        t = self._tensors.get((layer, name))
        return t is not None and t.shape[1] == width and t.dtype == dtype

    def conflicts(self, layout: list[tuple[int, str, int, torch.dtype]]) -> bool:
        """Whether the arena holds a tensor of this layout with another width or dtype (a plan
        of another LoRA rank keeps its `*_s` tensors narrower or wider): such a plan cannot use
        the arena while the other one does."""
        return any(self.has(layer, name) and not self.holds(layer, name, width, dtype)
                   for layer, name, width, dtype in layout)

    def reserve(self, layout: list[tuple[int, str, int, torch.dtype]]) -> bool:
        """Allocate the tensors of a plan's (layer, name, width, dtype) layout that are missing;
        False, with nothing allocated by this call kept, when the device memory is short."""
        new = []
        try:
            for layer, name, width, dtype in layout:
                if not self.has(layer, name):
                    self.tensor(layer, name, width, dtype)
                    new.append((layer, name))
        except torch.cuda.OutOfMemoryError:
            for key in new:
                del self._tensors[key]
            torch.cuda.empty_cache()
            logger.warning("no device memory for a %d-row activation arena: fine-tuning windows "
                           "of this plan run without CUDA graphs", self.num_rows)
            return False
        if new:
            logger.info("activation arena: %d rows, %.2f GiB reserved", self.num_rows,
                        self.num_bytes / 2**30)
        return True

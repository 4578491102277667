"""Per-step LoRA routing metadata, built once per step and shared by every LoRA layer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flexserve_kernels.lora.dropout_hash import row_seed


@dataclass(slots=True)
class LoRAKernelMeta:
    """Which adapter slot each token uses, as tokens and as contiguous same-slot segments."""

    token_slots: torch.Tensor  # [T] int32: adapter slot of each token, -1 = no adapter
    seg_starts: torch.Tensor  # [S] int32: first token of each segment that has an adapter
    seg_lens: torch.Tensor  # [S] int32: tokens in each such segment (>= 1)
    seg_slots: torch.Tensor  # [S] int32: the slot of each such segment (>= 0)
    num_tokens: int  # T
    max_seg_len: int  # longest segment; 0 when no token has an adapter
    decode_only: bool  # every segment has one token (BGMV-shaped batch)
    # the distinct slots of the batch (host side), so a linear whose slots hold no weights for
    # any of them skips its kernels; None (CUDA-graph capture): unknown, every linear runs them
    slots: frozenset[int] | None = None
    # [T] int32 segment of each token, -1 without an adapter: built on first use by
    # flexserve_kernels.lora.train.fused.token_segments and kept for the step's other layers
    token_segs: torch.Tensor | None = None
    # tokens with an adapter (host side); None: unknown (a kernel writing every row zeroes first)
    num_lora_tokens: int | None = None
    # [2, N] int32 (CUDA graphs): the SGMV kernels' token tiles as (segment, tile) pairs, row 0
    # the segments (-1: an empty entry), row 1 the tiles, so their grid is N whatever the batch;
    # built by `segment_tile_map` with `tile_block_m` tokens a tile. None: the grid follows the
    # batch (segments x tiles of the longest)
    tile_map: torch.Tensor | None = None
    tile_block_m: int = 0

    @property
    def num_segments(self) -> int:
        return int(self.seg_slots.shape[0])

    @property
    def has_lora(self) -> bool:
        return self.max_seg_len > 0

    @property
    def covers_all_tokens(self) -> bool:
        """Every token has an adapter: a kernel writing every adapter row writes the whole
        output, which needs no zero fill first. Without the adapter token count (a meta built
        by hand), only one segment of every token counts."""
        if self.num_lora_tokens is not None:
            return self.num_lora_tokens == self.num_tokens
        return self.num_segments == 1 and self.max_seg_len == self.num_tokens

    @classmethod
    def build(cls, row_lens: list[int], row_slots: list[int], device: torch.device | str) -> "LoRAKernelMeta":
        """From the rows of a flat batch: their token counts and slots (-1 for the base model).

        Consecutive rows with the same slot merge into one segment; rows without an adapter
        form no segment, so kernels never visit their tokens.
        """
        if len(row_lens) != len(row_slots):
            raise ValueError(f"{len(row_lens)} row lengths for {len(row_slots)} row slots")
        token_slots: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        slots: list[int] = []
        position = 0
        for n, slot in zip(row_lens, row_slots):
            if n <= 0:
                raise ValueError(f"a row must have at least one token, got {n}")
            token_slots.extend([slot] * n)
            if slot >= 0:
                if slots and slots[-1] == slot and starts[-1] + lens[-1] == position:
                    lens[-1] += n
                else:
                    starts.append(position)
                    lens.append(n)
                    slots.append(slot)
            position += n
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
        return cls(
            token_slots=as_tensor(token_slots),
            seg_starts=as_tensor(starts),
            seg_lens=as_tensor(lens),
            seg_slots=as_tensor(slots),
            num_tokens=position,
            max_seg_len=max(lens, default=0),
            decode_only=bool(lens) and max(lens) == 1,
            slots=frozenset(slots),
            num_lora_tokens=sum(lens),
        )


def segment_tile_map(lens: np.ndarray, block_m: int, num_entries: int,
                     last_tile_first: bool = False) -> np.ndarray:
    """[2, num_entries] int32: (row, tile) of every `block_m`-token tile of rows with `lens[row]`
    tokens, longest rows' tiles first (with `last_tile_first`, a row's tiles from its last:
    causal attention's heaviest), then (-1, 0) entries. ValueError when they do not fit."""
    lens = np.asarray(lens, dtype=np.int64)
    tiles = -(-lens // block_m)
    total = int(tiles.sum())
    if total > num_entries:
        raise ValueError(f"{total} tiles of {block_m} tokens do not fit a map of {num_entries}")
    out = np.zeros((2, num_entries), dtype=np.int32)
    out[0, total:] = -1
    order = np.argsort(-lens, kind="stable")
    rows = np.repeat(order, tiles[order])
    firsts = np.repeat(np.cumsum(tiles[order]) - tiles[order], tiles[order])
    out[0, :total] = rows
    out[1, :total] = np.arange(total) - firsts
    if last_tile_first:
        out[1, :total] = tiles[rows] - 1 - out[1, :total]
    return out


@dataclass(slots=True)
class DropoutWindows:
    """Row ranges of a batch whose LoRA dropout has its own seed and p, one (seed, p) per window
    and group, for kernel 1's row-window form (`lora_window_shrink_fwd`). The fine-tuning engine's
    windows: a window's mask hashes (sequence seed, layer, target, position), so each (layer,
    target) is a group. Rows outside every window get no dropout. On the device, in one int32
    tensor (one copy to build)."""

    bounds: torch.Tensor  # [W, 2] int32: each window's first row and row count
    # [G, W, 2] int32: per group and window, the seed under which batch row t hashes as
    # t * HASH_TOKEN + seed (mod 2**32) and p's float32 bits
    table: torch.Tensor
    has_dropout: bool  # some window has p > 0 in some group (host side: picks the dropout branch)

    @property
    def num_windows(self) -> int:
        return int(self.bounds.shape[0])

    @property
    def num_groups(self) -> int:
        return int(self.table.shape[0])

    @classmethod
    def build(cls, bounds: list[tuple[int, int]], seeds, ps, device: torch.device | str) -> "DropoutWindows":
        """bounds: (first row, row count) of each window, disjoint; seeds and ps: [G, W] (array-likes),
        the seed in [0, 2**32) under which the window's first row hashes as row 0 (as
        `dropout_keep_ref` takes it: `row_seed` shifts it to positions) and p in [0, 1)."""
        seeds = np.asarray(seeds, dtype=np.int64)
        if len(bounds) < 1 or seeds.size < 1:
            raise ValueError("dropout windows need at least one window and one group")
        firsts = np.array([b[0] for b in bounds], dtype=np.int64)
        counts = np.array([b[1] for b in bounds], dtype=np.int64)
        seeds = seeds.reshape(-1, len(bounds))
        ps = np.asarray(ps, dtype=np.float32).reshape(seeds.shape)
        if (firsts < 0).any() or (counts < 0).any():
            raise ValueError(f"window bounds must be non-negative, got {bounds}")
        order = np.argsort(firsts)
        if (firsts[order][1:] < (firsts + counts)[order][:-1]).any():
            raise ValueError(f"dropout windows overlap: {bounds}")
        if (seeds < 0).any() or (seeds >= 2**32).any():
            raise ValueError("window seeds must be in [0, 2**32)")
        if (ps < 0).any() or (ps >= 1).any():
            raise ValueError("dropout probabilities must be in [0, 1)")
        shifted = row_seed(seeds, -firsts).astype(np.uint32).view(np.int32)  # batch row t hashes as t
        table = np.stack([shifted, ps.view(np.int32)], axis=-1)
        packed = torch.from_numpy(np.concatenate([np.stack([firsts, counts], -1).astype(np.int32).ravel(),
                                                  table.ravel()]))
        if torch.device(device).type == "cuda":
            # pinned, so the copy does not wait for the stream's queued work (a pageable one does)
            packed = packed.pin_memory().to(device, non_blocking=True)
        else:
            packed = packed.to(device)
        num_windows = len(bounds)
        return cls(packed[:2 * num_windows].view(num_windows, 2), packed[2 * num_windows:].view(*table.shape),
                   bool((ps > 0).any()))

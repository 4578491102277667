"""LoRA dropout's counter hash: a 32-bit key per (seed, token, column), no state to store.

The fused LoRA kernels regenerate the mask from it in registers; the torch references, the
activation store and the per-window routing metadata (`DropoutWindows`) compute the same keys.
"""

from __future__ import annotations

import torch

# Hash constants (all below 2**31, so a 32-bit value times one fits in int64 without overflow).
HASH_TOKEN = 0x6A09E667
HASH_COLUMN = 0x3C6EF372 | 1
HASH_MIX1 = 0x7FEB352D
HASH_MIX2 = 0x2C1B3C6D
MASK32 = 0xFFFFFFFF


def mix32_ref(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xor-shift, multiply, twice) of int64 tensors in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * HASH_MIX1) & MASK32
    h = h ^ (h >> 15)
    h = (h * HASH_MIX2) & MASK32
    return h ^ (h >> 16)


def row_seed(seed: int, first_row: int) -> int:
    """The seed under which rows 0, 1, ... hash as rows first_row, first_row + 1, ... hash under
    `seed` (a token's key mixes seed + row * HASH_TOKEN mod 2**32): how a kernel given one window
    of a sequence regenerates the sequence's mask at the window's positions."""
    return (seed + first_row * HASH_TOKEN) & MASK32

"""Torch references for the fused LoRA training kernels (LoRAFusion's FusedLoRA / FusedMultiLoRA).

`lora_linear_train_ref` is the unfused PEFT computation, y = x W^T + scaling * B(A(dropout(x))),
per adapter slot, differentiable with torch.autograd; its dropout mask is the kernels' counter-based
hash of (seed, token, column) (`dropout_keep_ref`), so both sides drop the same elements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexserve_kernels.lora.dropout_hash import (
    HASH_COLUMN,
    HASH_MIX1,
    HASH_TOKEN,
    MASK32,
    mix32_ref,
    row_seed,
)
from flexserve_kernels.lora.serve.ref import lora_shrink_ref


def dropout_keep_ref(seed: int, num_tokens: int, num_cols: int, p: float,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """[num_tokens, num_cols] bool: the elements dropout with probability p keeps, as the kernels
    regenerate them (seed in [0, 2**32)); `row_seed` shifts the rows. Each token and each column
    gets a fully mixed 32-bit key (of the seed and the
    token; of the column); an element's hash is one multiply and xor-shift of their xor, and its
    top 24 bits are the uniform. The per-element work (6 integer ops) is what the kernels pay for
    every element they drop out, three times a training step; the keys cost one vector each."""
    tokens = torch.arange(num_tokens, dtype=torch.int64, device=device)[:, None]
    cols = torch.arange(num_cols, dtype=torch.int64, device=device)[None, :]
    row_keys = mix32_ref((seed + tokens * HASH_TOKEN) & MASK32)
    col_keys = mix32_ref((cols * HASH_COLUMN) & MASK32)
    h = ((row_keys ^ col_keys) * HASH_MIX1) & MASK32
    h = h ^ (h >> 16)
    uniform = (h >> 8).to(torch.float32) * (1.0 / (1 << 24))
    return uniform >= p


def lora_linear_train_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    scalings: list[float],
    dropout_ps: list[float],
    seed: int,
) -> torch.Tensor:
    """y [T, out] = x W^T, plus for tokens of slot s >= 0: scaling[s] * dropout(x) A[s]^T B[s]^T.

    x [T, in], weight [out, in], lora_a [slots, r_max, in], lora_b [slots, out, r_max]; computed
    unfused, in x's dtype, like PEFT's Linear (dropout scales kept elements by 1 / (1 - p)).
    """
    y = F.linear(x, weight)
    for slot in sorted(set(token_slots.tolist()) - {-1}):
        rows = (token_slots == slot).nonzero().flatten()
        xs = x[rows]
        p = dropout_ps[slot]
        if p > 0:
            keep = dropout_keep_ref(seed, x.shape[0], x.shape[1], p, x.device)[rows]
            xs = xs * keep.to(xs.dtype) / (1.0 - p)
        delta = F.linear(F.linear(xs, lora_a[slot]), lora_b[slot]) * scalings[slot]
        y = y.index_add(0, rows, delta.to(y.dtype))
    return y


def lora_train_shrink_ref(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, dropout_ps: list[float], seed: int
) -> torch.Tensor:
    """s [T, r_max] float32 = dropout(x) A[slot]^T per token, zero rows for tokens without an adapter."""
    s = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot in sorted(set(token_slots.tolist()) - {-1}):
        rows = (token_slots == slot).nonzero().flatten()
        xs = x[rows].float()
        p = dropout_ps[slot]
        if p > 0:
            xs = xs * dropout_keep_ref(seed, x.shape[0], x.shape[1], p, x.device)[rows] / (1.0 - p)
        s[rows] = xs @ lora_a[slot].float().T
    return s


def lora_window_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, meta, windows, group: int) -> torch.Tensor:
    """`lora_window_shrink_fwd`'s reference: s [T, r_max] float32 = dropout(x) A[slot]^T per segment of
    meta (a `LoRAKernelMeta`), each row of a window of `windows` (a `DropoutWindows`) with that
    window's (seed, p) of `group`, other rows without dropout; zero rows for tokens without an adapter."""
    xs = x.to(torch.float32, copy=True)  # x itself stays as it is
    table = windows.table[group].tolist()
    for (first, count), (shifted, p_bits) in zip(windows.bounds.tolist(), table):
        p = float(torch.tensor(p_bits, dtype=torch.int32).view(torch.float32))
        if p > 0 and count > 0:
            keep = dropout_keep_ref(row_seed(shifted & MASK32, first), count, x.shape[1], p, x.device)
            xs[first:first + count] = xs[first:first + count] * keep / (1.0 - p)
    return lora_shrink_ref(xs, lora_a, meta)

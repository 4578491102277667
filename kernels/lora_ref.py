"""Torch references for the segmented LoRA kernels (the test oracle and the CPU path)."""

from __future__ import annotations

import torch

from flexserve_kernels.lora_meta import LoRAKernelMeta


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
    """S[t] = x[t] @ lora_a[slot(t)].T for tokens with an adapter, 0 elsewhere.

    x: [T, in]; lora_a: [num_slots, max_rank, in]. Returns [T, max_rank] in float32.
    """
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for start, length, slot in zip(meta.seg_starts.tolist(), meta.seg_lens.tolist(), meta.seg_slots.tolist()):
        out[start : start + length] = x[start : start + length].float() @ lora_a[slot].float().T
    return out


def lora_expand_ref(
    s: torch.Tensor,
    lora_b: torch.Tensor,
    meta: LoRAKernelMeta,
    y: torch.Tensor,
    scaling: torch.Tensor,
) -> torch.Tensor:
    """y[t] += scaling[slot(t)] * s[t] @ lora_b[slot(t)].T, in place, for tokens with an adapter.

    s: [T, max_rank]; lora_b: [num_slots, out, max_rank]; y: [T, out]; scaling: [num_slots].
    """
    for start, length, slot in zip(meta.seg_starts.tolist(), meta.seg_lens.tolist(), meta.seg_slots.tolist()):
        delta = (s[start : start + length].float() @ lora_b[slot].float().T) * scaling[slot].float()
        y[start : start + length] += delta.to(y.dtype)
    return y

"""SiLU-and-mul of the MLP: one Triton kernel where `use_triton` says so, torch elsewhere."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from flexserve_kernels.dispatch import use_triton


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, lora: Any = None) -> torch.Tensor:
    """silu(gate) * up for gate, up [T, d], rounded as HF's `act_fn(gate) * up`. `lora`: the
    gate/up pair's pending folded LoRA bypass (a `FoldedLoRA`, Triton path only), added first."""
    if use_triton(gate.device):
        from flexserve_kernels.activation import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(gate, up, lora=lora)
    if lora is not None:
        raise ValueError("a folded LoRA bypass needs the Triton kernels")
    return F.silu(gate) * up

"""SiLU-and-mul of the MLP: one Triton kernel where `use_triton` says so, torch elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flexserve_kernels.dispatch import use_triton


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [T, d], rounded as HF's `act_fn(gate) * up`."""
    if use_triton(gate.device):
        from flexserve_kernels.activation import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(gate, up)
    return F.silu(gate) * up

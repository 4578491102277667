"""The gradients of one layer-wise backward window, by tensor name, summed as the ops' backwards
hand in their contributions (`WindowGradients.give`).

A tensor read by several ops (the layer input `x` by its norm and the residual add, a LoRA
target's input by the frozen projection and by the bypass) gets one contribution from each
reader's backward, and its gradient is their sum.

Torch path: every sum is a new fp32 tensor, so no contribution is ever written.

Fused path (`flexserve_kernels.finetune_backward` on CUDA): a sum may go in place, but only into a
fresh fp32 buffer that the window allocated for that one name ("owned"): a kernel's or a LoRA
GEMM's new output, or a sum this class allocated itself. Nothing else is ever written:

- the residual-gradient rows, which belong to the sequence: they hold dL/dx_next, the gradient
  of the layer's top op, which the residual add hands on to both of its inputs (`SequenceBackward`
  writes dL/dx into them itself, in or after the layer's last backward op, when nothing reads
  their old values any more);
- slices of the layer's KV-gradient accumulators, which also belong to the sequence: they sum
  every window's dK, dV of the layer, and rows [start, end) are this window's keys' and values'
  gradients only by aliasing;
- a tensor an add op hands to both of its inputs: summing into it for one name would change the
  other's gradient.

A value may also be held in the model's dtype when that is its exact value (a frozen linear's dX
GEMM product): it is never written either, and its first sum is a new fp32 tensor. An in-place
sum has the value the torch path's new tensor would have (fp32 addition commutes, widening a
16-bit value is exact): the bookkeeping itself changes no gradient, it only saves allocations.
"""

from __future__ import annotations

import torch


class WindowGradients:
    """dL/dtensor of one backward window by name, summed as the ops' contributions arrive.

    Torch path: each sum is a new fp32 tensor. Fused path: a value may be held in the model's
    dtype when that is its exact value (a dX GEMM's product); sums go in place into a buffer the
    window allocated for that name alone ("owned"); any other value (the residual rows, the KV
    accumulators' slices, a tensor an add op gave to both of its inputs) is never written.
    """

    def __init__(self, needed: dict[str, bool], fused: bool) -> None:
        self.needed = needed
        self.fused = fused
        self.values: dict[str, torch.Tensor] = {}
        self._owned: set[str] = set()

    def owns(self, name: str) -> bool:
        """Whether dL/d`name` is held in a buffer that only it uses (a sum may write into it)."""
        return name in self._owned

    def set_owned(self, name: str, owned: bool) -> None:
        """Record whether the value now held for `name` is a buffer that only it uses."""
        (self._owned.add if owned else self._owned.discard)(name)

    def drop(self, name: str) -> None:
        """Forget dL/d`name` (its producer's backward has read it: nothing else will)."""
        self.values.pop(name, None)
        self._owned.discard(name)

    def give(self, name: str, grad: torch.Tensor, fresh: bool = False) -> None:
        """Add `grad` to dL/d`name` (if needed); `fresh`: grad is a new tensor nothing else
        references, so the sum may reuse it."""
        if not self.needed.get(name, False):
            return
        old = self.values.get(name)
        fresh = fresh and grad.dtype == torch.float32
        if old is None:
            self.values[name] = grad
        elif not self.fused:
            self.values[name] = old + grad
        elif name in self._owned:
            old.add_(grad)  # fp32 += (widened) grad: the sum's exact fp32 value
            return
        elif fresh:
            self.values[name] = grad.add_(old)  # fp32 addition commutes: the same value
        elif old.dtype == grad.dtype != torch.float32:
            self.values[name] = old.float().add_(grad)
        else:
            self.values[name] = old + grad  # promotes to fp32
        if self.fused:
            self.set_owned(name, fresh or old is not None)

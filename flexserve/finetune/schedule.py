"""LR schedules equal to transformers' `get_{constant,linear,cosine}_schedule_with_warmup`.

Pure Python (no torch), so the engine can report the LR of any step. `lr_at(step)` is the LR of
the update numbered `step` (0-based): transformers' LambdaLR sets base_lr * factor(0) before the
first `optimizer.step()` and advances after each, so update k uses factor(k). The expressions are
written in transformers' order of operations, so the floats are bitwise equal to its schedulers.
"""

from __future__ import annotations

import math

from flexserve.finetune.hyperparameters import LR_SCHEDULERS


def lr_factor(step: int, lr_scheduler: str, warmup_steps: int, num_training_steps: int) -> float:
    """The multiplier of the peak LR for update `step` (0-based).

    Warmup rises linearly from 0 at step 0 to 1 at `warmup_steps`; then constant stays 1, linear
    falls to 0 at `num_training_steps`, cosine follows half a cosine period to 0 there.
    """
    if lr_scheduler not in LR_SCHEDULERS:
        raise ValueError(
            f"lr_scheduler must be one of {', '.join(LR_SCHEDULERS)}, got {lr_scheduler!r}")
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    if lr_scheduler == "constant":
        return 1.0
    span = float(max(1, num_training_steps - warmup_steps))
    if lr_scheduler == "linear":
        return max(0.0, float(num_training_steps - step) / span)
    progress = float(step - warmup_steps) / span
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def lr_at(step: int, learning_rate: float, lr_scheduler: str, warmup_steps: int,
          num_training_steps: int) -> float:
    """The learning rate of update `step` (0-based): learning_rate * lr_factor(...)."""
    return learning_rate * lr_factor(step, lr_scheduler, warmup_steps, num_training_steps)

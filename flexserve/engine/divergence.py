"""When a fine-tuning job has diverged although its loss is finite (plain Python).

The worker fails a job whose loss or gradient norm is NaN or infinite. A learning rate far too
high can instead saturate the model into predicting a uniform distribution: the loss settles at
ln(vocabulary size), finite, and the gradient vanishes, so every later step changes nothing and
the job would "succeed" with an adapter that learned nothing. `collapsed_reason` recognises that.
"""

from __future__ import annotations

import math

COLLAPSED_STEPS = 3  # consecutive collapsed steps before the job is failed
_ZERO_GRAD_NORM = 1e-12
_UNIFORM_LOSS_RTOL = 1e-3


def collapsed_reason(losses: list[float], grad_norms: list[float],
                     vocab_size: int | None) -> str | None:
    """Why a job whose loss is finite has nonetheless diverged, or None: its last
    `COLLAPSED_STEPS` steps had a zero gradient norm at a loss of ln(vocab_size), the loss of a
    uniform prediction. The model has saturated (a learning rate far too high): every further
    step changes nothing, so the job would "succeed" with a useless adapter."""
    if vocab_size is None or len(grad_norms) < COLLAPSED_STEPS:
        return None
    uniform = math.log(vocab_size)
    recent = zip(losses[-COLLAPSED_STEPS:], grad_norms[-COLLAPSED_STEPS:])
    if all(norm <= _ZERO_GRAD_NORM and abs(loss - uniform) <= _UNIFORM_LOSS_RTOL * uniform
           for loss, norm in recent):
        return (f"the gradient norm has been 0 for {COLLAPSED_STEPS} steps at a training loss of "
                f"{losses[-1]:.4f} = ln(vocabulary size): the model predicts a uniform "
                "distribution and learns nothing (it diverged); retry with a lower learning rate")
    return None

"""Which examples each optimizer step trains on (pure Python, no torch).

Each epoch visits every example once, in file order or in a seeded permutation of that epoch, and
cuts the order into consecutive batches of `batch_size`; the last batch of an epoch keeps the
remainder (torch's DataLoader with drop_last=False). Batches never span two epochs.

The permutation of epoch e is `random.Random(f"{seed}:{epoch}").shuffle(list(range(n)))`: a string
seed is hashed with SHA-512 (never with Python's salted `hash`), so the order is the same on every
run and machine, differs between epochs, and can be computed for one epoch alone (a resumed job
needs no replay). It is pure Python so the engine, which never imports torch, can plan steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# A job's plan lists every example of every epoch: bound its steps and its length (400 beyond).
MAX_TRAINING_STEPS = 100_000
MAX_TRAINED_EXAMPLES = 10_000_000  # n_epochs * examples in the training file


@dataclass(slots=True, frozen=True)
class TrainingStep:
    """One optimizer step: the examples whose loss tokens it averages over."""

    index: int  # 0-based step number over the whole job (the LR schedule's step)
    epoch: int  # 0-based epoch the batch belongs to
    example_indices: tuple[int, ...]  # indices into TrainingData.examples, in training order


def _check_counts(num_examples: int, batch_size: int, n_epochs: int) -> None:
    for name, value in (("num_examples", num_examples), ("batch_size", batch_size),
                        ("n_epochs", n_epochs)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def num_training_steps(num_examples: int, batch_size: int, n_epochs: int) -> int:
    """Optimizer steps of a job: n_epochs * ceil(num_examples / batch_size)."""
    _check_counts(num_examples, batch_size, n_epochs)
    return n_epochs * -(-num_examples // batch_size)


def check_plan_size(num_examples: int, batch_size: int, n_epochs: int) -> int:
    """The job's number of steps; ValueError naming the limit when the plan would exceed
    MAX_TRAINING_STEPS steps or MAX_TRAINED_EXAMPLES examples trained."""
    num_steps = num_training_steps(num_examples, batch_size, n_epochs)
    if num_steps > MAX_TRAINING_STEPS:
        raise ValueError(f"n_epochs {n_epochs} x {-(-num_examples // batch_size)} steps per "
                         f"epoch is {num_steps} optimizer steps, over the limit of "
                         f"{MAX_TRAINING_STEPS}: lower n_epochs or raise batch_size")
    if n_epochs * num_examples > MAX_TRAINED_EXAMPLES:
        raise ValueError(f"n_epochs {n_epochs} x {num_examples} examples is "
                         f"{n_epochs * num_examples} examples trained, over the limit of "
                         f"{MAX_TRAINED_EXAMPLES}: lower n_epochs")
    return num_steps


def epoch_order(num_examples: int, epoch: int, shuffle: bool, seed: int | None) -> list[int]:
    """The order in which epoch `epoch` (0-based) visits the examples."""
    order = list(range(num_examples))
    if shuffle:
        if type(seed) is not int:
            raise ValueError(f"shuffling needs an integer seed, got {seed!r}")
        random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def plan_training_steps(num_examples: int, batch_size: int, n_epochs: int, shuffle: bool,
                        seed: int | None) -> list[TrainingStep]:
    """Every step of a job, in order; len(result) == num_training_steps(...)."""
    _check_counts(num_examples, batch_size, n_epochs)
    steps: list[TrainingStep] = []
    for epoch in range(n_epochs):
        order = epoch_order(num_examples, epoch, shuffle, seed)
        for start in range(0, num_examples, batch_size):
            steps.append(TrainingStep(len(steps), epoch, tuple(order[start:start + batch_size])))
    return steps

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


def pack_sequences(lengths: list[int], max_bin_tokens: int | None, block_size: int = 1,
                   max_bin_blocks: int | None = None) -> list[list[int]]:
    """Group one optimizer step's sequences into bins that run concurrently (first-fit decreasing).

    `lengths[i]` is the token count of the step's i-th sequence. Returns bins of indices into
    `lengths`, each bin's members in training order; bins in the order FFD opens them (the one
    holding the longest sequence first). A bin holds at most `max_bin_tokens` tokens and, when
    `max_bin_blocks` is given, at most that many KV blocks of `block_size` tokens (each sequence
    rounds up to whole blocks), so a bin always fits in an idle cache. A sequence longer than
    `max_bin_tokens` is a bin of its own; None packs nothing (one sequence per bin, in order).

    This is LoRAFusion's batching of one global batch into microbatches under a token capacity
    (EuroSys'26, section 5.2), with its greedy packing only: FFD on lengths instead of the
    two-stage MILP (fewest bins, then the emptiest smallest bin), which the paper runs under a
    timeout with greedy packing as its fallback (it measures 3.8% more throughput from the MILP).
    Not taken: the padding multiple (rows are variable length, nothing is padded), the merge of
    underfilled microbatches across global batches (a bin never crosses an optimizer step, so
    every update sees exactly its step's examples) and the adapter grouping (jobs share iterations
    through the scheduler's job picker instead). LobRA's length buckets (VLDB'25) exist to
    dispatch sequences to replicas of different parallel configurations and to bound padding;
    with one replica and no padding the sorted FFD order plays their part.
    """
    if max_bin_tokens is not None and max_bin_tokens < 1:
        raise ValueError(f"max_bin_tokens must be >= 1 or None, got {max_bin_tokens!r}")
    if max_bin_tokens is None:
        return [[i] for i in range(len(lengths))]
    bins: list[list[int]] = []
    bin_tokens: list[int] = []
    bin_blocks: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        num_tokens, num_blocks = lengths[i], -(-lengths[i] // block_size)
        for k in range(len(bins)):
            if bin_tokens[k] + num_tokens <= max_bin_tokens and (
                    max_bin_blocks is None or bin_blocks[k] + num_blocks <= max_bin_blocks):
                bins[k].append(i)
                bin_tokens[k] += num_tokens
                bin_blocks[k] += num_blocks
                break
        else:
            bins.append([i])
            bin_tokens.append(num_tokens)
            bin_blocks.append(num_blocks)
    return [sorted(members) for members in bins]

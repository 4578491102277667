"""Random-token training data for fine-tuning tests."""

from __future__ import annotations

import torch

from flexserve.finetune.data import TrainingData, TrainingExample


def random_training_data(lengths: list[int], seed: int, vocab_size: int = 256) -> TrainingData:
    """One example per length: seeded random tokens, every token but the first in the loss."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, vocab_size, (n,), generator=g).tolist()
        examples.append(TrainingExample(i + 1, ids, [False] + [True] * (n - 1)))
    return TrainingData("text", examples, [], sum(lengths), sum(n - 1 for n in lengths))

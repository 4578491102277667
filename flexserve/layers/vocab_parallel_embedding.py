"""The token embedding split by vocabulary rows across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flexserve.distributed.parallel_state import TensorParallelGroup


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + num_rows) of the embedding on this rank: each rank looks
    up the ids it holds, zeros the others, and the all-reduce sums in the one real row."""

    def __init__(self, num_rows: int, embedding_dim: int, vocab_start: int, vocab_end: int,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, embedding_dim))
        self.vocab_start = vocab_start  # first vocabulary id of this rank
        self.vocab_end = vocab_end  # one past its last real id (the rows after it are padding)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        held = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * held
        out = F.embedding(local_ids, self.weight)
        out.mul_(held.unsqueeze(-1).to(out.dtype))
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return (f"rows={self.weight.shape[0]}, dim={self.weight.shape[1]}, "
                f"vocab=[{self.vocab_start}, {self.vocab_end}), rank={self.tp.rank}")

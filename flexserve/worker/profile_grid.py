"""What `flexserve profile` times: the grid of inference cases and fine-tuning scenarios.

`ProfileGrid.default` derives the grid from the engine's limits: prefill chunks (with and without
cached context), decode batches at several context lengths, and both mixed; fine-tuning sequences
whose forward windows and top layers' backward run alone, with inference rows riding along, or
overlapping the next sequence's forward. `ProfileGrid.heldout_cases` draws seeded random cases
from the same ranges, never fitted, for the error report. No torch here: `profile_executor`
(`flexserve.worker.profiler`) turns it into plans and times them.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class InferenceCase:
    """The inference rows of one profiled iteration."""

    prefill: list[tuple[int, int]] = field(default_factory=list)  # (num_computed, num_new > 1)
    decode_rows: int = 0  # rows with one new token
    decode_context: int = 1  # keys each decode row reads (num_computed + 1)


@dataclass(slots=True)
class FinetuneScenario:
    """A profiling sequence: its forward windows, then the backward of its top layers."""

    num_tokens: int  # sequence length
    forward_window: int  # tokens per forward window (the last may be shorter)
    backward_window: int  # tokens per backward window (the one at the sequence start may be shorter)
    backward_group: int = 1  # backward windows per iteration; more than a layer has: several layers
    inference: InferenceCase = field(default_factory=InferenceCase)  # rows in every iteration
    overlap: bool = False  # the next repeat's forward windows share iterations with this backward
    backward_layers: int | None = None  # top layers whose backward is timed (None: all)


@dataclass(slots=True)
class ProfileGrid:
    """Which iterations `profile_executor` times, and the ranges its held-out cases come from."""

    inference: list[InferenceCase]  # inference-only iterations
    finetune: list[FinetuneScenario]  # fine-tuning sequences (with inference rows riding along)
    max_tokens: int  # forward tokens of one iteration at most (the scheduler's token budget)
    max_context: int  # positions at most (max_model_len)
    max_rows: int  # decode rows at most (max_num_seqs)
    max_finetune_len: int  # the longest profiling sequence
    num_heldout_inference: int = 6  # random inference iterations held out of the fit
    num_heldout_finetune: int = 1  # random fine-tuning scenarios held out of the fit
    seed: int = 0  # token ids and held-out draws

    @classmethod
    def default(cls, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int,
                max_finetune_len: int, quick: bool = False) -> ProfileGrid:
        """The grid `flexserve profile` runs, within the engine's limits. `quick` fits a CPU
        (about a minute for SmolLM2-135M in fp32); the full grid is meant for GPUs."""
        m = min(max_num_batched_tokens, 256 if quick else 8192)  # tokens per iteration
        c = min(max_model_len, 1024 if quick else 16384)  # context
        r = min(max_num_seqs, 32 if quick else 256)  # decode rows
        n = min(max_finetune_len, max_model_len, m, 128 if quick else 2048)  # sequence length
        if min(m, c, n) < 16:
            raise ValueError("profiling needs a token budget, context and fine-tuning length of "
                             "at least 16 tokens")
        prefill = {16, 64, m // 2, m} if quick else set(_powers(16, m))
        inference = [InferenceCase([(0, k)]) for k in sorted(prefill)]
        inference += [InferenceCase([(ctx - k, k)]) for k in sorted({m // 16, m // 4})
                      for ctx in sorted({c // 2, c}) if ctx > k >= 2]
        rows = {1, 4, r // 2, r} if quick else set(_powers(1, r))
        contexts = {32, c // 2} if quick else {128, 1024, c // 4, c}
        inference += [InferenceCase(decode_rows=k, decode_context=ctx)
                      for k in sorted(rows - {0}) for ctx in sorted(contexts) if ctx <= c]
        inference += [InferenceCase([(0, p)], k, c // 4)
                      for p in sorted({m // 8, m // 2}) for k in sorted({max(1, r // 8), r // 2})
                      if k >= 1 and p >= 2 and p + k <= m]
        seq = FinetuneScenario
        # Backward over a few top layers: every layer costs the same (the bottom one a little
        # less: no input gradient), and the repeats come from the runs.
        finetune = [
            seq(n, n // 4, n // 4, backward_layers=2),
            seq(n, n // 2, n, 2, InferenceCase(decode_rows=max(1, r // 4), decode_context=c // 4),
                backward_layers=4),
            seq(n // 2, n // 8, n // 8, 4, InferenceCase([(0, m // 8)]), overlap=True,
                backward_layers=2),
        ]
        if not quick:
            finetune += [
                seq(n, n // 32, n // 16),
                seq(n, n // 2, n // 4, 1, InferenceCase([(c // 2, m // 4)], r // 8, c // 2),
                    backward_layers=4),
                seq(n // 4, n // 8, n // 4, 8, InferenceCase(decode_rows=r // 2,
                                                             decode_context=c // 8), True, 8),
            ]
        finetune = [s for s in finetune
                    if min(s.num_tokens, s.forward_window, s.backward_window) >= 1]
        return cls(inference, finetune, m, c, r, n,
                   num_heldout_inference=6 if quick else 24,
                   num_heldout_finetune=1 if quick else 3)

    def heldout_cases(self) -> tuple[list[InferenceCase], list[FinetuneScenario]]:
        """Random cases from the grid's ranges (seeded): log-uniform sizes, random mixes."""
        rng = random.Random(self.seed + 1)
        inference = [self._random_inference(rng, self.max_tokens)
                     for _ in range(self.num_heldout_inference)]
        finetune = []
        for _ in range(self.num_heldout_finetune):
            n = _log_uniform(rng, min(64, self.max_finetune_len), self.max_finetune_len)
            forward = _log_uniform(rng, min(16, n), n)
            backward = _log_uniform(rng, min(16, n), n)
            per_layer = -(-n // backward)
            rows = (self._random_inference(rng, self.max_tokens - forward)
                    if rng.random() < 0.7 and forward < self.max_tokens else InferenceCase())
            finetune.append(FinetuneScenario(
                n, forward, backward, rng.choice([1, 2, per_layer, 2 * per_layer]), rows,
                overlap=rng.random() < 0.5, backward_layers=2))
        return inference, finetune

    def _random_inference(self, rng: random.Random, max_tokens: int) -> InferenceCase:
        case = InferenceCase()
        budget = max_tokens
        if rng.random() < 0.6 and budget >= 2:
            num_new = _log_uniform(rng, 2, min(budget, self.max_context))
            num_computed = 0 if rng.random() < 0.5 else rng.randrange(
                self.max_context - num_new + 1)
            case.prefill.append((num_computed, num_new))
            budget -= num_new
        if budget >= 1 and (not case.prefill or rng.random() < 0.6):
            case.decode_rows = _log_uniform(rng, 1, min(budget, self.max_rows))
            case.decode_context = _log_uniform(rng, 16, self.max_context)
        return case

    def to_dict(self) -> dict:
        """JSON-ready (profile metadata)."""
        return asdict(self)


def _powers(lo: int, hi: int) -> list[int]:
    out, k = [], lo
    while k < hi:
        out.append(k)
        k *= 2
    return out + [hi]


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An int in [lo, hi], uniform in log space."""
    if hi <= lo:
        return lo
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))

"""Next-token sampling: grammar bitmasks, logit bias, penalties, temperature, top-k/top-p/min-p,
per-request seeds, logprobs.

`SamplingMetadata.build` turns the plan rows into tensors once per step (host work); after that
`Sampler.forward` is tensor work only, with no `.item()` and no host syncs (gpt-fast discipline),
vectorized over rows. The order of operations follows vLLM v1.
"""

from __future__ import annotations

import array
import functools
import itertools
from dataclasses import dataclass

import torch

from flexserve.engine.plan import ScheduledSequence, TokenLogprobs
from flexserve.layers.device_copy import to_device
from flexserve_kernels.dispatch import use_triton

_MASK64 = (1 << 64) - 1


def derive_seed(seed: int, step: int) -> int:
    """A 64-bit generator seed for output position `step` of a request seeded with `seed`.

    Stateless (splitmix64 of the pair), so a seeded request draws the same noise whatever the
    batch around it and however often it was preempted and recomputed.
    """
    z = ((seed & _MASK64) + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs for one step, as tensors on the sampling device. N rows, V vocab."""

    # [N] float32; 1.0 on greedy rows so the division is harmless; None when all rows are greedy
    temperature: torch.Tensor | None
    greedy: torch.Tensor | None  # [N] bool; rows that take the argmax; None when all are greedy
    all_greedy: bool  # no row samples randomly (skip the random path)
    all_random: bool  # no row is greedy (skip the argmax)
    top_k: torch.Tensor | None  # [N] int64 in [1, V] (V: disabled); None when no row uses it
    top_p: torch.Tensor | None  # [N] float32 (1.0: disabled); None when no row uses it
    min_p: torch.Tensor | None  # [N] float32 (0.0: disabled); None when no row uses it
    presence_penalties: torch.Tensor | None  # [N]; this and the next four are None w/o penalties
    frequency_penalties: torch.Tensor | None  # [N]
    repetition_penalties: torch.Tensor | None  # [N]
    output_token_counts: torch.Tensor | None  # [N, V] float32 occurrences in the generated tokens
    prompt_token_mask: torch.Tensor | None  # [N, V] bool: token occurs in the prompt
    min_tokens_rows: torch.Tensor | None  # [K] int64 row of each (row, token) pair to mask
    min_tokens_token_ids: torch.Tensor | None  # [K] int64 EOS / stop token to mask in that row
    seeded_rows: list[tuple[int, int]]  # (row, derived seed) of random rows that carry a seed
    needs_shared_generator: bool  # some random row has no seed
    num_logprobs: list[int | None]  # per row: requested top-k logprobs (None: not requested)
    max_num_logprobs: int | None  # max over rows; None when no row wants logprobs
    default_generator_seed: int  # seeds the Sampler's shared generator when it is created
    logit_bias_rows: torch.Tensor | None = None  # [B] int64 row of each (row, token) bias
    logit_bias_token_ids: torch.Tensor | None = None  # [B] int64 token the bias applies to
    logit_bias_values: torch.Tensor | None = None  # [B] float32 value added to that logit
    # [N, ceil(V / 32)] int32 on the device, set by the runner when a row carries a grammar:
    # bit j of word w allows token 32 * w + j (all bits set on unconstrained rows)
    token_bitmask: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        rows: list[ScheduledSequence],
        vocab_size: int,
        device: torch.device | str,
        default_generator_seed: int = 0,
    ) -> SamplingMetadata:
        """Tensors for `rows` (the plan rows with `needs_sample`, in order)."""
        all_params = [row.sampling_params for row in rows]
        if all(p.greedy and p.min_tokens == 0 and not p.has_penalties and not p.logit_bias
               for p in all_params):
            # The common decode batch: argmax only, so no per-row tensor is needed (each one
            # would be a host-to-device copy per step).
            num_logprobs = [p.logprobs for p in all_params]
            requested = [k for k in num_logprobs if k is not None]
            return cls(
                temperature=None, greedy=None, all_greedy=True, all_random=not rows,
                top_k=None, top_p=None, min_p=None, presence_penalties=None,
                frequency_penalties=None, repetition_penalties=None, output_token_counts=None,
                prompt_token_mask=None, min_tokens_rows=None, min_tokens_token_ids=None,
                seeded_rows=[], needs_shared_generator=False, num_logprobs=num_logprobs,
                max_num_logprobs=max(requested) if requested else None,
                default_generator_seed=default_generator_seed,
            )
        temperature, greedy, top_k, top_p, min_p = [], [], [], [], []
        seeded_rows: list[tuple[int, int]] = []
        needs_shared_generator = False
        min_tokens_rows: list[int] = []
        min_tokens_token_ids: list[int] = []
        bias_rows: list[int] = []
        bias_token_ids: list[int] = []
        bias_values: list[float] = []
        for i, row in enumerate(rows):
            params = row.sampling_params
            for token_id, bias in (params.logit_bias or {}).items():
                if token_id < vocab_size:
                    bias_rows.append(i)
                    bias_token_ids.append(token_id)
                    bias_values.append(bias)
            is_greedy = params.greedy
            greedy.append(is_greedy)
            temperature.append(1.0 if is_greedy else params.temperature)
            top_k.append(params.top_k if 0 < params.top_k < vocab_size else vocab_size)
            top_p.append(params.top_p)
            min_p.append(params.min_p)
            num_generated = len(row.output_token_ids)
            if not is_greedy:
                if row.seed is None:
                    needs_shared_generator = True
                else:
                    seeded_rows.append((i, derive_seed(row.seed, num_generated)))
            if num_generated < params.min_tokens:
                stop_ids = set(params.stop_token_ids)
                if row.eos_token_id is not None and not params.ignore_eos:
                    stop_ids.add(row.eos_token_id)
                for token_id in sorted(t for t in stop_ids if t < vocab_size):
                    min_tokens_rows.append(i)
                    min_tokens_token_ids.append(token_id)

        random_rows = [i for i, g in enumerate(greedy) if not g]
        _float = functools.partial(to_device, device=device, dtype=torch.float32)
        _long = functools.partial(to_device, device=device, dtype=torch.int64)
        penalties = _penalty_tensors(rows, vocab_size, device)
        num_logprobs = [row.sampling_params.logprobs for row in rows]
        requested = [k for k in num_logprobs if k is not None]
        return cls(
            temperature=_float(temperature),
            greedy=to_device(greedy, device, torch.bool),
            all_greedy=not random_rows,
            all_random=len(random_rows) == len(rows),
            top_k=_long(top_k) if any(top_k[i] < vocab_size for i in random_rows) else None,
            top_p=_float(top_p) if any(top_p[i] < 1.0 for i in random_rows) else None,
            min_p=_float(min_p) if any(min_p[i] > 0.0 for i in random_rows) else None,
            **penalties,
            min_tokens_rows=_long(min_tokens_rows) if min_tokens_rows else None,
            min_tokens_token_ids=_long(min_tokens_token_ids) if min_tokens_rows else None,
            seeded_rows=seeded_rows,
            needs_shared_generator=needs_shared_generator,
            num_logprobs=num_logprobs,
            max_num_logprobs=max(requested) if requested else None,
            default_generator_seed=default_generator_seed,
            logit_bias_rows=_long(bias_rows) if bias_rows else None,
            logit_bias_token_ids=_long(bias_token_ids) if bias_rows else None,
            logit_bias_values=_float(bias_values) if bias_rows else None,
        )


def _penalty_tensors(
    rows: list[ScheduledSequence], vocab_size: int, device: torch.device | str
) -> dict[str, torch.Tensor | None]:
    params = [row.sampling_params for row in rows]
    if not any(p.has_penalties for p in params):
        return dict.fromkeys(("presence_penalties", "frequency_penalties", "repetition_penalties",
                              "output_token_counts", "prompt_token_mask"))
    # Rows without penalties contribute no ids: their neutral factors ignore the counts anyway.
    output_ids = [row.output_token_ids if p.has_penalties else [] for row, p in zip(rows, params)]
    prompt_ids = [row.prompt_token_ids if p.repetition_penalty != 1.0 else []
                  for row, p in zip(rows, params)]
    _float = functools.partial(torch.tensor, dtype=torch.float32, device=device)
    return {
        "presence_penalties": _float([p.presence_penalty for p in params]),
        "frequency_penalties": _float([p.frequency_penalty for p in params]),
        "repetition_penalties": _float([p.repetition_penalty for p in params]),
        "output_token_counts": _token_counts(output_ids, vocab_size, device),
        "prompt_token_mask": _token_counts(prompt_ids, vocab_size, device) > 0,
    }


def _token_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[N, V] float32 occurrences of each token id per row, by one flat scatter_add."""
    lengths = [len(ids) for ids in token_ids]
    total = sum(lengths)
    # Flat ids, not padded rows: rows without penalties pass [] and then cost nothing.
    flat_ids = torch.zeros(0, dtype=torch.int64, device=device)
    if total:
        # Through an int64 array: about 2x faster than torch.tensor on a long Python list.
        buffer = array.array("q", itertools.chain.from_iterable(token_ids))
        flat_ids = torch.frombuffer(buffer, dtype=torch.int64).to(device)
    rows = torch.repeat_interleave(
        torch.arange(len(token_ids), device=device),
        torch.tensor(lengths, dtype=torch.int64, device=device),
        output_size=total,  # known here; otherwise the device would be asked (a sync)
    )
    # Column V is a sink for ids beyond the logits' vocabulary.
    flat_index = rows * (vocab_size + 1) + flat_ids.clamp(0, vocab_size)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.view(-1).scatter_add_(0, flat_index, torch.ones(total, device=device))
    return counts[:, :vocab_size]


@dataclass
class LogprobsTensors:
    """Log-probabilities at N positions: the chosen token's and the top-K alternatives'."""

    chosen_token_ids: torch.Tensor  # [N] int64: the sampled (or actual prompt) token
    chosen_logprobs: torch.Tensor  # [N] float32
    chosen_ranks: torch.Tensor  # [N] int64, 1-based: 1 + number of tokens with a higher logprob
    topk_token_ids: torch.Tensor  # [N, K] int64, highest logprob first
    topk_logprobs: torch.Tensor  # [N, K] float32, descending
    topk_ranks: torch.Tensor  # [N, K] int64: 1..K


@dataclass
class SamplerOutput:
    """What `Sampler.forward` returns."""

    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None  # raw-logit logprobs when some row requested them
    num_logprobs: list[int | None]  # per row: alternatives requested (None: no logprobs)

    def token_logprobs(self) -> list[TokenLogprobs]:
        """Per-row `TokenLogprobs`, each trimmed to its row's request; [] when none asked."""
        if self.logprobs is None:
            return []
        return to_token_logprobs(self.logprobs, [k or 0 for k in self.num_logprobs])


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_top: int) -> LogprobsTensors:
    """Logprob and rank of `token_ids` [N], and the `num_top` best entries of `logprobs` [N, V]."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    topk_logprobs, topk_ids = logprobs.topk(num_top, dim=1)
    topk_ranks = torch.arange(1, num_top + 1, device=logprobs.device).expand(len(token_ids), -1)
    return LogprobsTensors(token_ids, chosen, ranks, topk_ids, topk_logprobs, topk_ranks)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            num_top: int) -> LogprobsTensors:
    """Logprobs of the actual next prompt tokens `target_ids` [M] under `logits` [M, V]."""
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), target_ids, num_top)


def to_token_logprobs(
    tensors: LogprobsTensors, num_top: list[int | None] | int | None = None
) -> list[TokenLogprobs]:
    """Per-position `TokenLogprobs` for the plan contract, one device-to-host copy per tensor.

    `num_top` trims each position's alternatives (a list per row, or one int); None keeps all K.
    """
    chosen_ids = tensors.chosen_token_ids.tolist()
    chosen_logprobs = tensors.chosen_logprobs.tolist()
    chosen_ranks = tensors.chosen_ranks.tolist()
    topk_ids = tensors.topk_token_ids.tolist()
    topk_logprobs = tensors.topk_logprobs.tolist()
    topk_ranks = tensors.topk_ranks.tolist()
    if not isinstance(num_top, list):
        num_top = [num_top] * len(chosen_ids)
    result = []
    for i, k in enumerate(num_top):
        k = len(topk_ids[i]) if k is None else k
        result.append(TokenLogprobs(
            token_ids=[chosen_ids[i]] + topk_ids[i][:k],
            logprobs=[chosen_logprobs[i]] + topk_logprobs[i][:k],
            ranks=[chosen_ranks[i]] + topk_ranks[i][:k],
        ))
    return result


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits of tokens whose bit is 0 in `bitmask` [N, ceil(V / 32)] int32
    (xgrammar's layout: bit j of word w is token 32 * w + j); out of place, no host sync."""
    num_rows, vocab_size = logits.shape
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(num_rows, -1)[:, :vocab_size]
    return logits.masked_fill(allowed == 0, float("-inf"))


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Logit bias and min_tokens masking, then repetition, frequency and presence penalties
    (out of place)."""
    m = metadata
    if m.logit_bias_rows is not None:
        logits = logits.index_put((m.logit_bias_rows, m.logit_bias_token_ids),
                                  m.logit_bias_values, accumulate=True)
    if m.min_tokens_rows is not None:
        # A device-side fill: a Python-scalar value would mean a host-to-device copy.
        minus_inf = torch.full(m.min_tokens_rows.shape, float("-inf"), device=logits.device)
        logits = logits.index_put((m.min_tokens_rows, m.min_tokens_token_ids), minus_inf)
    if m.repetition_penalties is not None:
        counts = m.output_token_counts
        seen = m.prompt_token_mask | (counts > 0)
        factors = torch.where(seen, m.repetition_penalties.unsqueeze(1), 1.0)
        # CTRL: shrink positive logits and push negative ones further down.
        logits = torch.where(logits > 0, logits / factors, logits * factors)
        logits = (logits - m.frequency_penalties.unsqueeze(1) * counts
                  - m.presence_penalties.unsqueeze(1) * (counts > 0).float())
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf what falls outside each row's top-k and its smallest top-p nucleus."""
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # ascending
    vocab_size = logits.shape[-1]
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose total mass is <= 1 - p; what stays has mass >= p and is the
        # smallest such set. The best token always stays.
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's highest probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) for [N, V] logits: the two-launch Triton kernel where `use_triton`
    says so (torch's takes 27 us for a 128K vocabulary on an H200, the kernel 3.6), torch's
    otherwise. Same answer: the first index of the maximum."""
    if logits.dim() == 2 and logits.stride(1) == 1 and use_triton(logits.device):
        from flexserve_kernels.argmax import argmax

        return argmax(logits)
    return logits.argmax(dim=-1)


class Sampler(torch.nn.Module):
    """Picks the next token of each row. Owns the generator shared by unseeded rows.

    The generator is seeded from `seed`, or when None from the first metadata's
    `default_generator_seed`, and lives on the logits' device (made up front when both `seed`
    and `device` are given).
    """

    def __init__(self, seed: int | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self._seed = seed
        self._generator: torch.Generator | None = None
        if seed is not None and device is not None:
            self._generator = self._new_generator(torch.device(device), seed)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample from `logits` [N, V]; logprobs come from the raw logits (vLLM's default), after
        the grammar bitmask (as vLLM applies it before its sampler)."""
        logits = logits.float()
        if metadata.token_bitmask is not None:
            logits = apply_token_bitmask(logits, metadata.token_bitmask)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_penalties(logits, metadata)
        if metadata.all_greedy:
            sampled = row_argmax(logits)
        else:
            random_ids = self._sample_random(logits, metadata)
            sampled = (random_ids if metadata.all_random
                       else torch.where(metadata.greedy, row_argmax(logits), random_ids))
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, logprobs, metadata.num_logprobs)

    def _sample_random(self, logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
        logits = logits / m.temperature.unsqueeze(1)
        if m.top_k is not None or m.top_p is not None:
            logits = apply_top_k_top_p(logits, m.top_k, m.top_p)
        if m.min_p is not None:
            logits = apply_min_p(logits, m.min_p)
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a sample from p, with no
        # multinomial (and no host sync).
        return row_argmax(probs.div_(self._exponential_noise(probs, m)))

    def _exponential_noise(self, probs: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
        noise = torch.empty_like(probs)
        if m.needs_shared_generator:
            noise.exponential_(generator=self._shared_generator(probs.device, m))
        else:
            noise.fill_(1.0)
        for row, seed in m.seeded_rows:
            noise[row].exponential_(generator=self._new_generator(probs.device, seed))
        # exponential_ can return exactly 0 (u == 0); 0 / 0 would be NaN, which argmax picks.
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    def _shared_generator(self, device: torch.device, m: SamplingMetadata) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            seed = m.default_generator_seed if self._seed is None else self._seed
            self._generator = self._new_generator(device, seed)
        return self._generator

    @staticmethod
    def _new_generator(device: torch.device, seed: int) -> torch.Generator:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed & _MASK64)
        return generator

"""Sampler: greedy, logprobs, seeds, top-k/top-p/min-p, penalties, min_tokens, distribution."""

from __future__ import annotations

import math

import pytest
import torch

from flexserve.engine.plan import ScheduledSequence
from flexserve.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    compute_prompt_logprobs,
    derive_seed,
    to_token_logprobs,
)
from flexserve.sampling_params import SamplingParams


def _row(params: SamplingParams, output_ids=(), prompt_ids=(1, 2, 3), seed=None, eos=None):
    return ScheduledSequence(
        request_id="r", new_token_ids=[0], num_computed_tokens=0, block_ids=[],
        needs_sample=True, sampling_params=params, prompt_token_ids=list(prompt_ids),
        output_token_ids=list(output_ids), eos_token_id=eos, seed=seed,
    )


def _sample(logits, rows, sampler=None):
    metadata = SamplingMetadata.build(rows, logits.shape[-1], "cpu", default_generator_seed=0)
    return (sampler or Sampler()).forward(logits, metadata)


def _logits(num_rows, vocab_size, seed=0):
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_input_is_not_modified():
    logits = _logits(8, 50)
    before = logits.clone()
    rows = [_row(SamplingParams(temperature=0.0, min_tokens=2), eos=int(i)) for i in range(8)]
    rows[3] = _row(SamplingParams(temperature=0.0))
    out = _sample(logits, rows)
    masked = logits.clone()
    masked[torch.arange(8), torch.arange(8)] = float("-inf")  # each row's EOS is masked
    expected = torch.where(torch.arange(8) == 3, logits.argmax(-1), masked.argmax(-1))
    assert torch.equal(out.sampled_token_ids, expected)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.token_logprobs() == []
    assert torch.equal(logits, before)


def test_logprobs_are_log_softmax_of_raw_logits_with_ranks():
    logits = _logits(5, 40, seed=1)
    params = [SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0),
              SamplingParams(temperature=0.8, logprobs=0, seed=3),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.5, logprobs=5, top_k=4),
              SamplingParams(temperature=0.0, logprobs=1)]
    rows = [_row(p, output_ids=[int(logits[i].argmax())], seed=p.seed)
            for i, p in enumerate(params)]
    out = _sample(logits, rows)
    reference = torch.log_softmax(logits, -1)
    lp = out.logprobs
    assert torch.equal(lp.chosen_token_ids, out.sampled_token_ids)
    chosen_reference = reference.gather(1, out.sampled_token_ids[:, None])[:, 0]
    torch.testing.assert_close(lp.chosen_logprobs, chosen_reference)
    order = reference.argsort(dim=-1, descending=True)
    for i in range(5):
        rank = (order[i] == out.sampled_token_ids[i]).nonzero().item() + 1
        assert lp.chosen_ranks[i].item() == rank
    assert lp.topk_token_ids.shape == (5, 5)
    assert torch.equal(lp.topk_token_ids, order[:, :5])
    torch.testing.assert_close(lp.topk_logprobs, reference.gather(1, order[:, :5]))
    assert torch.all(lp.topk_logprobs[:, :-1] >= lp.topk_logprobs[:, 1:])
    assert lp.topk_ranks.tolist() == [[1, 2, 3, 4, 5]] * 5

    entries = out.token_logprobs()
    assert [len(e.token_ids) for e in entries] == [4, 1, 1, 6, 2]
    assert entries[0].token_ids[1:] == order[0, :3].tolist()
    assert entries[0].ranks[1:] == [1, 2, 3]
    assert entries[3].logprobs[0] == pytest.approx(reference[3, out.sampled_token_ids[3]].item())
    assert [len(e.token_ids) for e in to_token_logprobs(lp)] == [6] * 5


def test_compute_prompt_logprobs():
    logits = _logits(6, 30, seed=2)
    targets = torch.tensor([4, 0, 29, 7, 7, 1])
    tensors = compute_prompt_logprobs(logits, targets, num_top=2)
    reference = torch.log_softmax(logits, -1)
    entries = to_token_logprobs(tensors)
    for i, entry in enumerate(entries):
        target = targets[i].item()
        assert entry.token_ids[0] == target
        assert entry.logprobs[0] == pytest.approx(reference[i, target].item())
        assert entry.ranks[0] == int((reference[i] > reference[i, target]).sum()) + 1
        assert entry.token_ids[1:] == reference[i].topk(2).indices.tolist()


def _seeded_tokens(seed, num_steps, others, position):
    """Tokens of a seeded request on a flat 1000-token vocab, batched among `others`."""
    tokens = []
    for step in range(num_steps):
        rows = [_row(SamplingParams(seed=s), output_ids=[0] * step, seed=s) for s in others]
        rows.insert(position, _row(SamplingParams(seed=seed), output_ids=tokens, seed=seed))
        out = _sample(torch.zeros(len(rows), 1000), rows)
        tokens.append(out.sampled_token_ids[position].item())
    return tokens


def test_same_seed_same_tokens_whatever_the_batch():
    alone = _seeded_tokens(1234, 8, others=[], position=0)
    assert _seeded_tokens(1234, 8, others=[5, None, 7], position=2) == alone
    assert _seeded_tokens(1234, 8, others=[None, None], position=0) == alone
    assert _seeded_tokens(1235, 8, others=[], position=0) != alone
    assert len(set(alone)) > 1  # steps draw fresh noise
    assert derive_seed(-1, 0) != derive_seed(-1, 1) != derive_seed(0, 1)


def test_unseeded_rows_follow_the_shared_generator():
    rows = [_row(SamplingParams()) for _ in range(4)]
    a = _sample(torch.zeros(4, 1000), rows, Sampler(seed=9)).sampled_token_ids
    b = _sample(torch.zeros(4, 1000), rows, Sampler(seed=9, device="cpu")).sampled_token_ids
    sampler = Sampler(seed=10)
    c = _sample(torch.zeros(4, 1000), rows, sampler).sampled_token_ids
    d = _sample(torch.zeros(4, 1000), rows, sampler).sampled_token_ids
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(c, d)


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                                    SamplingParams(temperature=1e-3), SamplingParams(min_p=0.999)])
def test_degenerate_filters_are_greedy(params):
    logits = _logits(64, 100, seed=3)
    out = _sample(logits, [_row(params) for _ in range(64)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def _token_frequencies(logits_row, params, num_samples=4000):
    logits = torch.tensor(logits_row).repeat(num_samples, 1)
    out = _sample(logits, [_row(params) for _ in range(num_samples)], Sampler(seed=7))
    return torch.bincount(out.sampled_token_ids, minlength=len(logits_row)).tolist()


def test_top_p_keeps_the_smallest_set_with_enough_mass():
    log_probs = [math.log(p) for p in (0.1, 0.5, 0.15, 0.25)]
    # Mass 0.5 + 0.25 = 0.75 >= 0.7 while 0.5 alone is not: tokens 0 and 2 are out.
    counts = _token_frequencies(log_probs, SamplingParams(top_p=0.7))
    assert counts[0] == counts[2] == 0 and counts[1] > 0 and counts[3] > 0
    assert counts[1] / counts[3] == pytest.approx(2.0, rel=0.15)
    counts = _token_frequencies(log_probs, SamplingParams(top_p=0.8))
    assert counts[0] == 0 and min(counts[1:]) > 0


def test_top_k_keeps_the_k_best():
    counts = _token_frequencies([0.0, 2.0, 1.0, 1.5, -1.0], SamplingParams(top_k=2))
    assert counts[0] == counts[2] == counts[4] == 0 and min(counts[1], counts[3]) > 0


def test_min_p_drops_tokens_below_the_scaled_max():
    log_probs = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    counts = _token_frequencies(log_probs, SamplingParams(min_p=0.2))  # threshold p = 0.1
    assert counts[3] == 0 and min(counts[:3]) > 0


def test_penalties_match_a_hand_computed_reference():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0],
                           [2.0, -1.0, 0.5, -0.5, 1.0, 3.0]])
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    rows = [_row(params, output_ids=[1, 1, 2, 5], prompt_ids=[3, 0]),
            _row(SamplingParams(), output_ids=[1, 5], prompt_ids=[3])]
    metadata = SamplingMetadata.build(rows, 6, "cpu")
    penalized = apply_penalties(logits, metadata)
    counts = {1: 2, 2: 1, 5: 1}
    expected = []
    for token, value in enumerate(logits[0].tolist()):
        if token in counts or token in (3, 0):
            value = value / 1.5 if value > 0 else value * 1.5
        value -= 0.3 * counts.get(token, 0) + 0.2 * (token in counts)
        expected.append(value)
    torch.testing.assert_close(penalized[0], torch.tensor(expected))
    torch.testing.assert_close(penalized[1], logits[1])  # no penalties: untouched
    # Greedy rows take the argmax of the penalized logits: token 5 (3.0 -> 1.0) loses to 0 (2.0).
    greedy = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    out = _sample(logits[:1], [_row(greedy, output_ids=[5], prompt_ids=[])])
    assert out.sampled_token_ids.tolist() == [0]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[9.0, 8.0, 7.0, 0.0, 1.0]]).repeat(4, 1)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    rows = [_row(params, output_ids=[], eos=0),  # masks EOS 0 and stop id 1
            _row(params, output_ids=[4], eos=0),
            _row(params, output_ids=[4, 4], eos=0),  # min_tokens reached
            _row(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), eos=0)]
    out = _sample(logits, rows)
    assert out.sampled_token_ids.tolist() == [2, 2, 0, 0]
    sampled = _sample(logits[:1].repeat(500, 1) / 4,
                      [_row(SamplingParams(min_tokens=1, stop_token_ids=[1]), eos=0)] * 500)
    assert not set(sampled.sampled_token_ids.tolist()) & {0, 1}


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_follows_softmax(seeded):
    logits = torch.tensor([1.0, 0.5, -0.5, 0.0])
    temperature = 0.7
    num_samples = 20000 if not seeded else 5000
    rows = [_row(SamplingParams(temperature=temperature, seed=i if seeded else None),
                 seed=i if seeded else None) for i in range(num_samples)]
    out = _sample(logits.repeat(num_samples, 1), rows, Sampler(seed=42))
    observed = torch.bincount(out.sampled_token_ids, minlength=4).double()
    expected = torch.softmax(logits.double() / temperature, -1) * num_samples
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 25.0  # 3 degrees of freedom: p < 2e-5 for a correct sampler

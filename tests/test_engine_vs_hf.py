"""End-to-end greedy generation on SmolLM2 (fp32, CPU) is token-identical to HF `generate`.

Covers the scheduler paths that must not change results: plain continuous batching, chunked
prefill under a tiny token budget, preemption with recompute under a tiny KV cache, and prefix
cache hits for prompts that share a prefix.
"""

from __future__ import annotations

import pytest
import torch

from flexserve import LLM, SamplingParams

MAX_NEW_TOKENS = 24
SHARED = (
    "The following is a list of facts about the solar system, written for a school textbook "
    "and checked by an astronomer. Fact number "
)
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three primary colors:",
    SHARED + "one:",
    SHARED + "two:",
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def hf_greedy(hf_model, tokenizer) -> list[list[int]]:
    """HF's greedy continuation of each prompt, one prompt at a time (no padding effects)."""
    outputs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False, pad_token_id=tokenizer.eos_token_id,
            )
            new = out[0, ids.shape[1]:].tolist()
            if tokenizer.eos_token_id in new:  # HF keeps the EOS token; so do we
                new = new[: new.index(tokenizer.eos_token_id) + 1]
            outputs.append(new)
    return outputs


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)


def _generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_greedy_matches_hf(smollm2_dir, hf_greedy):
    llm = LLM(smollm2_dir, max_model_len=512)
    assert _generate(llm) == hf_greedy
    assert llm.engine.scheduler.kv_cache_usage == 0.0


def test_greedy_matches_hf_with_chunked_prefill(smollm2_dir, hf_greedy):
    llm = LLM(smollm2_dir, max_model_len=512, max_num_batched_tokens=16)
    assert _generate(llm) == hf_greedy


def test_greedy_matches_hf_under_preemption(smollm2_dir, hf_greedy):
    # 6 blocks of 16 tokens cannot hold seven sequences as they grow: decode must preempt.
    llm = LLM(smollm2_dir, max_model_len=96, num_blocks=6, max_num_batched_tokens=64)
    assert _generate(llm) == hf_greedy
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions_total > 0
    assert scheduler.kv_cache_usage == 0.0


def test_greedy_matches_hf_with_prefix_cache_hits(smollm2_dir, hf_greedy):
    llm = LLM(smollm2_dir, max_model_len=512)
    first = llm.generate(PROMPTS[4:6], GREEDY, use_tqdm=False)
    # The second round hits the blocks of the shared prefix and of the whole prompts.
    second = llm.generate(PROMPTS[4:6], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == hf_greedy[4:6]
    assert [o.outputs[0].token_ids for o in second] == hf_greedy[4:6]
    assert first[1].num_cached_tokens >= 16  # the shared prefix, computed by the first request
    assert all(o.num_cached_tokens >= 16 for o in second)


def test_logprobs_equal_hf_log_softmax(smollm2_dir, hf_model, tokenizer):
    llm = LLM(smollm2_dir, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    ids = out.prompt_token_ids + completion.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), dim=-1)
    num_prompt = len(out.prompt_token_ids)
    for i, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[num_prompt - 1 + i]
        assert abs(position[token].logprob - row[token].item()) < 1e-4
        top = torch.topk(row, 5)
        assert list(position)[:1] == [token]
        alternatives = {t: lp for t, lp in position.items()}
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(alternatives[t].logprob - lp) < 1e-4
    assert out.prompt_logprobs[0] is None
    for p in range(1, num_prompt):
        entry = out.prompt_logprobs[p]
        token = out.prompt_token_ids[p]
        assert abs(entry[token].logprob - ref[p - 1, token].item()) < 1e-4
    assert completion.cumulative_logprob == pytest.approx(
        sum(completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids))
    )

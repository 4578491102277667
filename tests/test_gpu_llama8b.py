"""On CUDA, bf16: a dummy Llama-3.1-8B-shaped model matches HF transformers on the same weights.

Random weights make the next-token distribution nearly flat, so greedy tokens are compared on the
first step only (later steps diverge after any near-tie flips); the main check is teacher-forced:
the log-probability of every prompt token, which does not cascade.
"""

from __future__ import annotations

import pytest
import torch

from flexserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def pair():
    llm = LLM("llama-3.1-8b", load_format="dummy", dtype="bfloat16", max_model_len=2048,
              gpu_memory_utilization=0.55)
    from transformers import AutoModelForCausalLM

    config = llm.engine.core.executor.hf_config
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ours = llm.engine.core.executor.model.state_dict()
    missing, unexpected = hf.load_state_dict(ours, strict=False)
    assert not missing, missing
    return llm, hf


def test_prompt_logprobs_and_first_token_match_hf(pair):
    llm, hf = pair
    g = torch.Generator().manual_seed(0)
    lengths = [37, 128, 300, 512]
    prompts = [torch.randint(100, 128000, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    same_first = 0
    for prompt, out in zip(prompts, outputs):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)
        ours = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
        theirs = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], device="cuda")].cpu()
        rel = (ours - theirs).norm() / theirs.norm()
        assert rel < 1e-2, f"prompt of {len(prompt)}: relative error {rel:.2e}"
        same_first += int(out.outputs[0].token_ids[0] == int(logits[-1].argmax()))
    assert same_first >= len(prompts) - 1


def test_batch_decode_is_deterministic_and_complete(pair):
    llm, _ = pair
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 128000, (512,), generator=g).tolist() for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    a = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in a)
    assert llm.engine.scheduler.kv_cache_usage == 0.0

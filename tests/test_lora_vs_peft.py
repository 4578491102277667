"""flexserve with LoRA adapters equals HF `PeftModel` on SmolLM2 (fp32, CPU).

Adapters are made by `peft` itself (seeded random A and non-zero B, so they change the output) and
saved with `save_pretrained`, for three target sets and ranks (rsLoRA on one). Greedy tokens must
match `PeftModel.generate` token for token; the log-probabilities of the generated tokens must
match a `PeftModel` forward within LOGPROB_ATOL. A batch mixing base-model rows and the three
adapters must give each row exactly what it gets alone, also when two slots force adapters to take
turns and prompts are prefilled in chunks. A tiny random Qwen2 covers projections with biases.
"""

from __future__ import annotations

import pytest
import torch

from flexserve import LLM, LoRARequest, SamplingParams
from flexserve.layers.lora_linear import LoRALinear

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# LoraConfig kwargs and the std of the random lora_B: each large enough that the adapter changes
# the greedy tokens of at least one prompt (a small adapter on q/v barely moves SmolLM2).
ADAPTERS = {
    "qv-r4": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), 0.2),
    "all-r64-rslora": (dict(r=64, lora_alpha=16, use_rslora=True, target_modules=ALL), 0.03),
    "down-r16": (dict(r=16, lora_alpha=32, target_modules=["down_proj"]), 0.1),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]
MAX_NEW_TOKENS = 10
# fp32 on CPU: flexserve's flat-batch kernels and HF's padded ones round differently; measured
# max difference 2e-5 on these adapters.
LOGPROB_ATOL = 2e-4
MAX_LORA_RANK = 64


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def hf_greedy(model, tokenizer, prompt: str) -> list[int]:
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    new = out[0, ids.shape[1]:].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id) + 1]
    return new


def randomize_lora(peft_model, seed: int, b_std: float) -> None:
    """Seeded A (PEFT's init range, U(+-1/sqrt(in))) and B ~ N(0, b_std): the adapter does not
    depend on the global RNG state that earlier tests leave behind."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in peft_model.named_parameters():
            if "lora_A" in param_name:
                bound = param.shape[1] ** -0.5
                param.copy_((torch.rand(param.shape, generator=generator) * 2 - 1) * bound)
            elif "lora_B" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * b_std)


@pytest.fixture(scope="module")
def references(smollm2_dir, tokenizer, tmp_path_factory):
    """Adapters written by peft, and HF's greedy tokens and PeftModels' logprob function."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    refs = {"base": {"tokens": [hf_greedy(model, tokenizer, p) for p in PROMPTS]}}
    for i, (name, (kwargs, b_std)) in enumerate(ADAPTERS.items()):
        peft_model = get_peft_model(model, LoraConfig(**kwargs)).eval()
        randomize_lora(peft_model, seed=100 + i, b_std=b_std)
        path = tmp_path_factory.mktemp(name)
        peft_model.save_pretrained(path)
        tokens = [hf_greedy(peft_model, tokenizer, p) for p in PROMPTS]
        ids = tokenizer.encode(PROMPTS[0]) + tokens[0]
        with torch.inference_mode():
            logprobs = torch.log_softmax(peft_model(torch.tensor([ids])).logits[0].double(), -1)
        refs[name] = {"path": str(path), "tokens": tokens, "logprobs": logprobs}
        model = peft_model.unload()  # back to the plain base model for the next adapter
    return refs


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(smollm2_dir, max_model_len=256, kv_cache_gib=0.25, enable_lora=True,
               max_loras=4, max_lora_rank=MAX_LORA_RANK)


def lora_requests(references) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, references[name]["path"])
            for i, name in enumerate(ADAPTERS)}


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=0)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_greedy_equals_peft_model_generate(llm, references, tokenizer, name):
    request = lora_requests(references)[name]
    outputs = llm.generate(PROMPTS, GREEDY, lora_request=request, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == references[name]["tokens"]
    assert tokens != references["base"]["tokens"]  # the adapter really changes the output
    # Logprobs of the generated tokens against a PeftModel forward over prompt + output.
    ref = references[name]["logprobs"]
    num_prompt = len(outputs[0].prompt_token_ids)
    completion = outputs[0].outputs[0]
    for i, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert position[token].logprob == pytest.approx(
            ref[num_prompt - 1 + i, token].item(), abs=LOGPROB_ATOL)


def test_base_rows_are_untouched_with_lora_enabled(llm, references):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == references["base"]["tokens"]


def mixed_batch(references) -> tuple[list[str], list[LoRARequest | None], list[list[int]]]:
    """Every prompt under the base model and under each adapter, interleaved."""
    requests = lora_requests(references)
    prompts, loras, expected = [], [], []
    for p, prompt in enumerate(PROMPTS):
        for name in ["base", *ADAPTERS]:
            prompts.append(prompt)
            loras.append(None if name == "base" else requests[name])
            expected.append(references[name]["tokens"][p])
    return prompts, loras, expected


def test_a_mixed_batch_equals_each_row_alone(llm, references):
    prompts, loras, expected = mixed_batch(references)
    alone = [llm.generate(p, GREEDY, lora_request=r, use_tqdm=False)[0].outputs[0].token_ids
             for p, r in zip(prompts, loras)]
    assert alone == expected
    together = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == alone
    scheduler = llm.engine.scheduler
    assert scheduler.kv_cache_usage == 0.0
    assert scheduler.adapter_manager.num_running_by_name() == dict.fromkeys(ADAPTERS, 0)


def test_fewer_slots_than_adapters_and_chunked_prefill(smollm2_dir, references):
    # Two slots for three adapters: adapters take turns; 8-token budget: prompts are chunked.
    small = LLM(smollm2_dir, max_model_len=128, kv_cache_gib=0.1, enable_lora=True, max_loras=2,
                max_lora_rank=MAX_LORA_RANK, max_cpu_loras=2, max_num_batched_tokens=8)
    prompts, loras, expected = mixed_batch(references)
    together = small.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == expected
    assert small.engine.scheduler.adapter_manager.num_resident == 2
    assert small.engine.executor.num_cpu_loras == 2
    assert small.engine.scheduler.kv_cache_usage == 0.0


def test_tiny_qwen2_with_projection_biases_equals_peft(tiny_config, tiny_checkpoint, tmp_path):
    """Biased q/k/v (Qwen2) stay the backbone's; checkpoint names load through LoRALinear."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(tiny_config("qwen2"), seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=8, target_modules=ALL)).eval()
    randomize_lora(peft_model, seed=7, b_std=0.1)
    peft_model.save_pretrained(tmp_path / "adapter")
    prompts = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6]]
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = peft_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                      do_sample=False, pad_token_id=0, eos_token_id=None)
            expected.append(out[0, len(prompt):].tolist())
    llm = LLM(path, max_model_len=64, kv_cache_gib=0.01, enable_lora=True, max_loras=1,
              max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    lora = LoRARequest("tiny", 1, str(tmp_path / "adapter"))
    outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    base = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base] != expected
    # LoRA disabled: plain nn.Linear projections (no wrapper at all), same base outputs.
    plain = LLM(path, max_model_len=64, kv_cache_gib=0.01, enable_lora=False)
    q_proj = plain.engine.executor.model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is torch.nn.Linear
    assert type(llm.engine.executor.model.model.layers[0].self_attn.q_proj) is LoRALinear
    again = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in base]

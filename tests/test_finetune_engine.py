"""Token-level fine-tuning through the engine (CPU, fp32, SmolLM2) against ordinary training.

Training exactness: from the same PEFT `init_adapter` (non-zero B), with shuffle off, the adapter
after 3 optimizer steps equals a plain HF transformers + peft + torch.optim.AdamW loop on the same
examples (loss = mean token cross-entropy over the step's loss tokens), while a token budget of 16
cuts every sequence into many forward windows and backward windows, with inference requests in the
same steps. The truth is that loop in fp64. Adam's normalization magnifies fp32 rounding where a
gradient is near zero, so the fp32 HF loop itself is 8.6e-4 off its fp64 run in the constant-LR
case (5.6e-5 with clipping; relative error of the weight change over all adapter tensors,
measured 2026-11-21), while flexserve (fp32) is 2.7e-4 and 9.2e-6 off it. The bound: flexserve's
error <= max(1e-4, the fp32 HF loop's), i.e. within 1e-4 wherever fp32 training can be, and never
worse than ordinary fp32 training; each tensor alone within 1e-2. Also: inference rows sharing
iterations with fine-tuning rows give the tokens inference alone gives; every fine-tuning KV block
is free after the job; bad input is refused.
"""

from __future__ import annotations

import pytest
import torch

from flexserve import LLM, SamplingParams

from _hf_training import load_saved

TARGETS = ["q_proj", "v_proj", "down_proj"]
DATA = [
    {"prompt": "Q: What colour is the sky? A:", "completion": " Blue, on a clear day."},
    {"prompt": "Translate to French: cat ->", "completion": " chat"},
    {"prompt": "2 + 2 =", "completion": " 4"},
    {"prompt": "The secret word is", "completion": " marmalade, always."},
    {"prompt": "Name a prime number:", "completion": " 7"},
    {"prompt": "Opposite of hot:", "completion": " cold"},
]
PROMPTS = ["The capital of France is", "def add(a, b):"]


@pytest.fixture(scope="module")
def init_adapter(smollm2_dir, tmp_path_factory):
    """A PEFT LoRA adapter (r 8, alpha 16) with seeded non-zero A and B, saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                param.copy_((torch.rand(param.shape, generator=g) * 2 - 1) * param.shape[1] ** -0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.02)
    path = tmp_path_factory.mktemp("init")
    peft_model.save_pretrained(path)
    return str(path)


def reference_training(smollm2_dir, init_adapter, examples, steps, hp,
                       dtype=torch.float32) -> dict[str, torch.Tensor]:
    """HF + peft + torch.optim.AdamW over the same examples and steps."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, get_scheduler

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=dtype)
    model = PeftModel.from_pretrained(model, init_adapter, is_trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=hp["learning_rate"], weight_decay=0.0)
    schedule = get_scheduler(hp.get("lr_scheduler", "linear"), optimizer,
                             num_warmup_steps=hp.get("warmup_steps", 0),
                             num_training_steps=len(steps))
    for step in steps:
        num_loss_tokens = sum(sum(examples[i].loss_mask) for i in step)
        loss = 0.0
        for i in step:
            ids = torch.tensor([examples[i].input_ids])
            logits = model(ids).logits[0, :-1]
            mask = torch.tensor(examples[i].loss_mask[1:])
            ce = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            loss = loss + (ce * mask).sum() / num_loss_tokens
        loss.backward()
        if hp.get("max_grad_norm") is not None:
            torch.nn.utils.clip_grad_norm_(params, hp["max_grad_norm"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir, enable_lora=True, max_lora_rank=16, max_model_len=128,
               max_num_batched_tokens=16)


@pytest.mark.parametrize("hp", [
    {"learning_rate": 1e-3, "lr_scheduler": "constant", "max_grad_norm": None},
    {"learning_rate": 2e-3, "lr_scheduler": "linear", "warmup_steps": 1, "max_grad_norm": 0.5},
], ids=["constant-noclip", "linear-clip"])
def test_training_equals_hf_peft_adamw(llm, smollm2_dir, init_adapter, tmp_path, hp):
    from flexserve.finetune.data import load_training_data

    params = dict(hp, batch_size=2, n_epochs=1, shuffle=False)
    job = llm.finetune(DATA, lora={"init_adapter": init_adapter, "target_modules": TARGETS,
                                   "r": 8, "alpha": 16}, hyperparameters=params)
    # Inference in the same steps as the windows: generate while the job is running.
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12),
                           use_tqdm=False)
    job.wait()
    assert job.status == "succeeded" and len(job.losses) == 3
    ours = load_saved(job.save(str(tmp_path / "tuned")))

    import json

    from _hf_training import check_against_fp64

    data = load_training_data("".join(json.dumps(d) + "\n" for d in DATA).encode(),
                              llm.get_tokenizer(), 128)
    steps = [[0, 1], [2, 3], [4, 5]]
    hf32 = reference_training(smollm2_dir, init_adapter, data.examples, steps, hp)
    hf64 = reference_training(smollm2_dir, init_adapter, data.examples, steps, hp, torch.float64)
    initial = load_saved(init_adapter)
    assert len(ours) == 3 * 30 * 2
    check_against_fp64(ours, hf32, hf64, initial)
    # The inference rows were not disturbed by the fine-tuning rows beside them.
    alone = LLM(smollm2_dir, max_model_len=128).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in alone]
    assert llm.engine.scheduler.kv_cache_usage == 0.0
    llm.engine.scheduler.kv_cache_manager.check_invariants()


def test_bad_finetune_input_is_refused(llm):
    with pytest.raises(ValueError, match="line 1"):
        llm.finetune([{"text": ""}])
    with pytest.raises(ValueError, match="learning_rate"):
        llm.finetune(DATA, hyperparameters={"learning_rate": -1})
    with pytest.raises(ValueError, match="target"):
        llm.finetune(DATA, lora={"target_modules": ["nope"]})
    with pytest.raises(ValueError, match="init_adapter"):
        llm.finetune(DATA, lora={"init_adapter": "no-such-adapter"})
    with pytest.raises(ValueError, match="max_lora_rank 16"):
        llm.finetune(DATA, lora={"r": 32})
    assert llm.engine.scheduler.adapter_manager.num_resident == 0  # the slot was given back


def test_finetune_needs_no_flag_unless_lora_is_turned_off(smollm2_dir):
    llm = LLM(smollm2_dir, max_model_len=64)  # LoRA slots by default
    job = llm.finetune(DATA, lora={"r": 4, "alpha": 8}, hyperparameters={"n_epochs": 1})
    job.wait()
    assert job.status == "succeeded" and job.num_steps >= 1
    off = LLM(smollm2_dir, max_model_len=64, enable_lora=False)
    with pytest.raises(ValueError, match="LoRA is not enabled.*--no-enable-lora"):
        off.finetune(DATA)


def test_max_finetune_len_is_bounded_by_the_context(smollm2_dir):
    with pytest.raises(ValueError, match="max_finetune_len 65 exceeds max_model_len 64"):
        LLM(smollm2_dir, max_model_len=64, max_finetune_len=65, enable_lora=True)
    llm = LLM(smollm2_dir, max_model_len=64, max_finetune_len=8, enable_lora=True)
    job = llm.finetune([{"text": "a very long example " * 20}], lora={"r": 4, "alpha": 8})
    assert "truncated" in job.events[0] and "8" in job.events[0]
    job.wait()
    assert job.status == "succeeded" and llm.engine.scheduler.kv_cache_usage == 0.0

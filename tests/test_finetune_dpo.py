"""DPO fine-tuning through the engine (CPU, fp32, SmolLM2) against a hand-written DPO loop.

Exactness: the adapter after 3 optimizer steps of DPO equals HF transformers + peft +
torch.optim.AdamW computing the sigmoid DPO loss by hand (`flexserve.finetune.dpo`'s formula,
the reference log-probabilities taken under the job's starting point: the backbone alone for
PEFT's init, the backbone plus the `init_adapter` otherwise), while a token budget of 16 cuts
each side into many forward and backward windows and inference requests ride in the same steps.
The truth is that loop in fp64; the bound is the supervised tests' (test_finetune_engine.py):
flexserve's relative error of the weight change <= max(1e-4, the fp32 HF loop's), each tensor
within 1e-2. Also: the step metrics equal the reference's, every KV block is free afterwards, and
bad data or a wrong method is refused naming the line or field.
"""

from __future__ import annotations

import json

import pytest
import torch

from flexserve import LLM, SamplingParams
from flexserve.finetune.data import load_training_data

from _hf_training import check_against_fp64, load_saved

TARGETS = ["q_proj", "v_proj", "down_proj"]
BETA = 0.5


def pair(question: str, chosen: str, rejected: str) -> dict:
    return {"input": {"messages": [{"role": "user", "content": question}]},
            "preferred_output": [{"role": "assistant", "content": chosen}],
            "non_preferred_output": [{"role": "assistant", "content": rejected}]}


PAIRS = [
    pair("What colour is the sky?", "Blue.", "Green, like grass in the summer."),
    pair("2 + 2 =", "4", "5"),
    pair("Name a prime number.", "7 is prime.", "Nine."),
    pair("Opposite of hot?", "Cold.", "Warm, I think, or maybe tepid."),
    pair("Say hello in French.", "Bonjour!", "Hola."),
    pair("Is water wet?", "Yes.", "No, never."),
]
PROMPTS = ["The capital of France is", "def add(a, b):"]


def dpo_reference(model_dir, adapter_dir, examples, steps, hp, reference_adapter,
                  dtype=torch.float32) -> tuple[dict[str, torch.Tensor], list[float]]:
    """HF + peft + AdamW with the DPO loss by hand: the trained adapter and each step's loss.
    `examples[2i]`, `examples[2i + 1]`: pair i's chosen and rejected sides; `steps`: pair
    indices; `reference_adapter`: whether the reference keeps the starting adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, get_scheduler

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)

    def logprob(i: int) -> torch.Tensor:
        ids = torch.tensor([examples[i].input_ids])
        logits = model(ids).logits[0, :-1]
        mask = torch.tensor(examples[i].loss_mask[1:])
        ce = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        return -(ce * mask).sum()

    with torch.no_grad():
        if reference_adapter:
            reference = [logprob(i) for i in range(len(examples))]
        else:
            with model.disable_adapter():
                reference = [logprob(i) for i in range(len(examples))]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=hp["learning_rate"], weight_decay=0.0)
    schedule = get_scheduler(hp.get("lr_scheduler", "linear"), optimizer, num_warmup_steps=0,
                             num_training_steps=len(steps))
    losses = []
    for step in steps:
        loss = 0.0
        for p in step:
            c, r = 2 * p, 2 * p + 1
            z = BETA * ((logprob(c) - reference[c]) - (logprob(r) - reference[r]))
            loss = loss - torch.nn.functional.logsigmoid(z) / len(step)
        loss.backward()
        losses.append(float(loss))
        if hp.get("max_grad_norm") is not None:
            torch.nn.utils.clip_grad_norm_(params, hp["max_grad_norm"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, losses


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir, enable_lora=True, max_lora_rank=16, max_model_len=128,
               max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def init_adapter(smollm2_dir, tmp_path_factory):
    from _hf_training import save_random_peft_adapter

    return save_random_peft_adapter(smollm2_dir, tmp_path_factory.mktemp("dpo-init"), TARGETS,
                                    torch.Generator().manual_seed(1), 0.02)


@pytest.mark.parametrize("start", ["peft-init", "init-adapter"])
def test_dpo_equals_hf_peft_adamw(llm, smollm2_dir, init_adapter, tmp_path, start):
    hp = {"learning_rate": 2e-3, "lr_scheduler": "linear", "max_grad_norm": 0.5,
          "batch_size": 2, "n_epochs": 1, "shuffle": False, "beta": BETA, "seed": 3}
    lora = {"target_modules": TARGETS, "r": 8, "alpha": 16}
    if start == "init-adapter":
        lora["init_adapter"] = init_adapter
    job = llm.finetune(PAIRS, lora=lora, hyperparameters=hp, method="dpo")
    initial_dir = init_adapter if start == "init-adapter" else job.save(str(tmp_path / "init"))
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12),
                           use_tqdm=False)
    job.wait()
    assert job.status == "succeeded" and len(job.losses) == 3
    assert any("Reference log-probabilities computed for 6 pairs" in e for e in job.events)
    ours = load_saved(job.save(str(tmp_path / "tuned")))

    data = load_training_data("".join(json.dumps(d) + "\n" for d in PAIRS).encode(),
                              llm.get_tokenizer(), 128)
    assert data.is_preference and data.num_items == 6
    steps = [[0, 1], [2, 3], [4, 5]]
    reference_adapter = start == "init-adapter"
    hf32, losses32 = dpo_reference(smollm2_dir, initial_dir, data.examples, steps, hp,
                                   reference_adapter)
    hf64, losses64 = dpo_reference(smollm2_dir, initial_dir, data.examples, steps, hp,
                                   reference_adapter, torch.float64)
    initial = load_saved(initial_dir)
    assert len(ours) == 3 * 30 * 2
    check_against_fp64(ours, hf32, hf64, initial)
    # The first step starts at the reference: margin 0, loss log 2; later ones follow HF's.
    assert job.losses[0] == pytest.approx(0.6931471805599453, abs=1e-4)
    # Step losses: no further from the fp64 truth than 4x HF's own fp32 loop (the adapter's
    # bound), or 1e-5 absolute.
    assert len(job.losses) == len(losses64) == len(losses32)
    for ours_loss, loss32, loss64 in zip(job.losses, losses32, losses64):
        assert abs(ours_loss - loss64) <= max(4 * abs(loss32 - loss64), 1e-5), (
            job.losses, losses32, losses64)
    metrics = job.dpo_metrics
    assert len(metrics) == 3 and set(metrics[0]) == {
        "loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"}
    for m in metrics:
        assert m["rewards/margin"] == pytest.approx(m["rewards/chosen"] - m["rewards/rejected"])
        assert m["rewards/accuracy"] in (0.0, 0.5, 1.0)
    alone = LLM(smollm2_dir, max_model_len=128).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in alone]
    assert llm.engine.scheduler.kv_cache_usage == 0.0
    llm.engine.scheduler.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("record, match", [
    ({"input": {"messages": [{"role": "user", "content": "q"}]},
      "preferred_output": [{"role": "assistant", "content": "a"}]},
     "line 2: missing key.*non_preferred_output"),
    (dict(PAIRS[0], preferred_output=[{"role": "assistant", "content": ""}]),
     r"line 2: preferred_output\[0\]: empty content"),
    (dict(PAIRS[0], non_preferred_output=[{"role": "user", "content": "x"}]),
     r"line 2: non_preferred_output\[0\] has role 'user'"),
    (dict(PAIRS[0], preferred_output=[]), "line 2: \"preferred_output\" must be a list of exactly"),
    (dict(PAIRS[0], input={"messages": []}), "line 2: \"input.messages\" must be a non-empty"),
    (dict(PAIRS[0], input={"messages": [{"role": "user", "content": "q"}], "tools": []}),
     "line 2: \"input\" has unsupported key"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "line 2: a messages example, but line 1 is a preference example"),
])
def test_bad_preference_data_names_the_line(llm, record, match):
    with pytest.raises(ValueError, match=match):
        llm.finetune([PAIRS[0], record], method="dpo")


def test_method_and_data_must_agree(llm):
    with pytest.raises(ValueError, match="method dpo trains on preference pairs"):
        llm.finetune([{"prompt": "a", "completion": "b"}], method="dpo")
    with pytest.raises(ValueError, match="train on them with method dpo"):
        llm.finetune(PAIRS)
    with pytest.raises(ValueError, match="beta is a hyper-parameter of the dpo method"):
        llm.finetune([{"prompt": "a", "completion": "b"}], hyperparameters={"beta": 0.1})
    with pytest.raises(ValueError, match="beta must be > 0"):
        llm.finetune(PAIRS, method="dpo", hyperparameters={"beta": 0})
    with pytest.raises(ValueError, match="method must be one of supervised, dpo"):
        llm.finetune(PAIRS, method="ppo")
    assert llm.engine.scheduler.adapter_manager.num_resident == 0


def test_a_resumed_dpo_job_keeps_its_reference_and_trains_the_same_adapter(llm, tmp_path):
    """The checkpoint carries the reference log-probabilities: a job resumed after step 1
    (its adapter then differs from the reference) ends with the uninterrupted job's adapter."""
    hp = {"learning_rate": 1e-3, "batch_size": 1, "n_epochs": 1, "shuffle": False,
          "beta": BETA, "seed": 5}
    lora = {"target_modules": ["v_proj"], "r": 4, "alpha": 8}
    whole = llm.finetune(PAIRS[:2], lora=lora, hyperparameters=hp, method="dpo").wait()
    first = llm.finetune(PAIRS[:2], lora=lora, hyperparameters=hp, method="dpo")
    while not first.losses:
        llm.engine.step()
    checkpoint = first.checkpoint(str(tmp_path / "step-1"))
    first.cancel()
    with open(f"{checkpoint}/trainer_state.json") as f:
        assert len(json.load(f)["reference_logprobs"]) == 4
    resumed = llm.finetune(PAIRS[:2], lora=lora, hyperparameters=hp, method="dpo",
                           resume_from=checkpoint).wait()
    assert not any("Reference log-probabilities" in e for e in resumed.events)
    assert resumed.losses == whole.losses and len(whole.losses) == 2
    ours, theirs = (load_saved(j.save(str(tmp_path / j.id))) for j in (resumed, whole))
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].equal(theirs[key]), key
    with pytest.raises(ValueError, match="resume it with method dpo"):
        llm.finetune([{"prompt": "a", "completion": "b"}] * 2, lora=lora,
                     hyperparameters={"batch_size": 1}, resume_from=checkpoint)

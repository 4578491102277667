"""Fine-tuning checkpoints (CPU, fp32): written atomically at step boundaries, loadable by `peft`
and by flexserve's LoRA serving, and resumed exactly.

Exactness: a job trained k steps, checkpointed, and resumed in a NEW engine ends with the adapter
of the uninterrupted run bit for bit (torch.equal), with the same losses and grad norms for the
remaining steps (==). The resumed run repeats the same float operations in the same order (same
bins, windows, sequence ids and dropout masks, AdamW state restored exactly), so nothing less is
expected on the CPU.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from flexserve import LLM, LoRARequest, SamplingParams
from flexserve.finetune.checkpoint import (
    OPTIMIZER_CONFIG_NAME,
    OPTIMIZER_STATE_NAME,
    TRAINER_STATE_NAME,
    commit_directory,
    read_trainer_state,
)
from flexserve.finetune.data import TrainingData, TrainingExample
from flexserve.finetune.hyperparameters import Hyperparameters
from flexserve.finetune.optimizer import AdapterOptimizer

TARGETS = ["q_proj", "v_proj", "down_proj"]
LENGTHS = [9, 14, 6, 11, 8, 13, 5, 10, 12, 7, 9, 6, 15, 4, 8, 10]  # 4 steps of 4


@pytest.fixture(scope="module")
def model_dir(tiny_config, tiny_checkpoint):
    config = tiny_config("llama", hidden_size=128, intermediate_size=256,
                         max_position_embeddings=128)
    return tiny_checkpoint(config, seed=4)


def make_data(lengths: list[int], seed: int = 1) -> TrainingData:
    g = torch.Generator().manual_seed(seed)
    examples = [TrainingExample(i + 1, torch.randint(0, 256, (n,), generator=g).tolist(),
                                [False] + [True] * (n - 1)) for i, n in enumerate(lengths)]
    return TrainingData("text", examples, [], sum(lengths), sum(n - 1 for n in lengths))


def hyperparameters(**overrides) -> Hyperparameters:
    # Warmup, a decaying LR, clipping, dropout and shuffling: all of them must resume exactly.
    values = {"batch_size": 4, "n_epochs": 1, "shuffle": True, "seed": 3, "learning_rate": 1e-2,
              "lr_scheduler": "linear", "warmup_steps": 1, "max_grad_norm": 0.5,
              "lora": {"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": TARGETS}}
    lora = overrides.pop("lora", {})
    values.update(overrides)
    values["lora"].update(lora)
    return Hyperparameters.from_dict(values)


def new_llm(model_dir: str) -> LLM:
    # A 16-token budget: bins of several sequences whose windows span iterations.
    return LLM(model_dir, enable_lora=True, max_lora_rank=8, max_model_len=64,
               max_num_batched_tokens=16)


def load(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def run_to_end(llm: LLM, job, on_step=None) -> list:
    """Step until the job ends; `on_step(update)` sees every "step" update right away."""
    updates = []
    while not job.finished:
        llm.engine.step()
        for update in llm.engine.pop_finetune_updates():
            updates.append(update)
            if update.kind == "step" and on_step is not None:
                on_step(update)
    return updates


@pytest.fixture(scope="module")
def uninterrupted(model_dir, tmp_path_factory):
    """The reference run, which also checkpoints after step 2 from its update listener."""
    path = tmp_path_factory.mktemp("run")
    llm = new_llm(model_dir)
    job = llm.engine.add_finetune_job(make_data(LENGTHS), hyperparameters())

    def on_step(update):
        assert llm.engine.scheduler.finetune.jobs[job.job_id].at_step_boundary
        if update.step == 2:
            llm.engine.save_finetune_checkpoint(job.job_id, str(path / "step-2"))

    updates = run_to_end(llm, job, on_step)
    assert job.status.value == "succeeded"
    llm.engine.save_finetune_checkpoint(job.job_id, str(path / "final"))
    return {"job": job, "updates": updates, "step2": str(path / "step-2"),
            "final": str(path / "final"), "adapter": load(path / "final")}


def test_resume_in_a_new_engine_equals_the_uninterrupted_run(model_dir, uninterrupted):
    ref = uninterrupted["job"]
    assert [(u.kind, u.step) for u in uninterrupted["updates"]] == [
        ("step", 1), ("step", 2), ("step", 3), ("step", 4), ("succeeded", 4)]
    checkpoint = uninterrupted["step2"]
    assert sorted(os.listdir(checkpoint)) == sorted([
        "adapter_config.json", "adapter_model.safetensors", OPTIMIZER_CONFIG_NAME,
        OPTIMIZER_STATE_NAME, TRAINER_STATE_NAME])
    assert not os.path.exists(checkpoint + ".tmp")
    state = read_trainer_state(checkpoint)
    assert (state.step, state.num_steps, state.num_sequences_started) == (2, 4, 8)
    assert state.losses == ref.losses[:2] and state.grad_norms == ref.grad_norms[:2]
    with open(os.path.join(checkpoint, OPTIMIZER_CONFIG_NAME)) as f:
        assert json.load(f)["num_completed_steps"] == 2

    llm = new_llm(model_dir)
    job = llm.engine.add_finetune_job(make_data(LENGTHS), hyperparameters(),
                                      resume_from=checkpoint)
    assert job.step_index == 2 and job.losses == ref.losses[:2]
    updates = run_to_end(llm, job)
    assert [(u.kind, u.step) for u in updates] == [("step", 3), ("step", 4), ("succeeded", 4)]
    assert job.status.value == "succeeded" and job.num_steps == 4 and len(job.losses) == 4
    assert job.losses == ref.losses and job.grad_norms == ref.grad_norms
    assert (job.num_forward_tokens, job.num_backward_tokens) == (
        ref.num_forward_tokens, ref.num_backward_tokens)
    assert [u.num_trained_tokens for u in updates][-1] == sum(LENGTHS)
    llm.engine.save_finetune_adapter(job.job_id, str(os.path.dirname(checkpoint) + "/resumed"))
    resumed = load(os.path.dirname(checkpoint) + "/resumed")
    final = uninterrupted["adapter"]
    assert sorted(resumed) == sorted(final)
    assert all(torch.equal(resumed[k], final[k]) for k in final)
    # The checkpoint's own weights changed from step 2 on: the comparison is not vacuous.
    assert not all(torch.equal(load(checkpoint)[k], final[k]) for k in final)
    assert llm.engine.scheduler.kv_cache_usage == 0.0


def test_the_checkpoint_loads_in_peft_and_serves_in_flexserve(model_dir, uninterrupted):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoint = uninterrupted["final"]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = [5, 17, 42, 99, 3, 250]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        base_logits = base(ids).logits
        model = PeftModel.from_pretrained(base, checkpoint)
        weights = load(checkpoint)
        for name, param in model.named_parameters():
            if "lora_" in name:
                assert torch.equal(param, weights[name.replace(".default", "")])
        assert (model(ids).logits - base_logits).abs().max() > 1e-2  # the adapter matters
        greedy = list(prompt)
        for _ in range(6):
            greedy.append(int(model(torch.tensor([greedy])).logits[0, -1].argmax()))
    served = LLM(model_dir, enable_lora=True, max_lora_rank=8, max_model_len=64)
    out = served.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False, lora_request=LoRARequest("tuned", 1, checkpoint))
    assert out[0].outputs[0].token_ids == greedy[len(prompt):]


def test_checkpoint_rules_and_resume_checks(model_dir, uninterrupted, tmp_path):
    llm = new_llm(model_dir)
    engine = llm.engine
    data = make_data(LENGTHS)
    job = engine.add_finetune_job(data, hyperparameters())
    engine.save_finetune_checkpoint(job.job_id, str(tmp_path / "ckpt"))  # step 0: fine
    assert read_trainer_state(str(tmp_path / "ckpt")).step == 0
    engine.step()
    with pytest.raises(ValueError, match="step boundary"):
        engine.save_finetune_checkpoint(job.job_id, str(tmp_path / "ckpt"))
    assert read_trainer_state(str(tmp_path / "ckpt")).step == 0  # untouched
    while job.step_index < 1:
        engine.step()
    engine.save_finetune_checkpoint(job.job_id, str(tmp_path / "ckpt"))  # replaces the old one
    assert read_trainer_state(str(tmp_path / "ckpt")).step == 1
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no .tmp or .old left behind
    engine.cancel_finetune_job(job.job_id)

    step2 = uninterrupted["step2"]
    with pytest.raises(ValueError, match="optimizer steps"):
        engine.add_finetune_job(data, hyperparameters(batch_size=2), resume_from=step2)
    with pytest.raises(ValueError, match="other examples"):
        engine.add_finetune_job(make_data(LENGTHS, seed=2), hyperparameters(), resume_from=step2)
    with pytest.raises(ValueError, match="does not match the job's LoRA settings"):
        engine.add_finetune_job(data, hyperparameters(lora={"r": 4, "alpha": 8}),
                                resume_from=step2)
    with pytest.raises(ValueError, match=r"optimizer settings differ in \['learning_rate'\]"):
        engine.add_finetune_job(data, hyperparameters(learning_rate=2e-2), resume_from=step2)
    with pytest.raises(ValueError, match="trainer_state.json is missing"):
        engine.add_finetune_job(data, hyperparameters(), resume_from=str(tmp_path))
    assert engine.scheduler.adapter_manager.num_resident == 0  # every refused job's slot back
    # The final checkpoint has nothing left to train: the job succeeds at once.
    done = engine.add_finetune_job(data, hyperparameters(), resume_from=uninterrupted["final"])
    assert done.status.value == "succeeded" and done.losses == uninterrupted["job"].losses
    assert [u.kind for u in engine.pop_finetune_updates()][-1] == "succeeded"


def test_commit_directory_is_all_or_nothing(tmp_path):
    target = str(tmp_path / "ckpt")

    def write(text):
        def fill(path):
            with open(os.path.join(path, "a.txt"), "w") as f:
                f.write(text)
            if text == "crash":
                raise OSError("disk full")
        return fill

    commit_directory(target, write("one"))
    with pytest.raises(OSError, match="disk full"):
        commit_directory(target, write("crash"))
    with open(os.path.join(target, "a.txt")) as f:
        assert f.read() == "one"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    os.makedirs(target + ".tmp")  # left by a crash: cleared by the next write
    commit_directory(target, write("two"))
    with open(os.path.join(target, "a.txt")) as f:
        assert f.read() == "two"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_optimizer_checkpoint_state_round_trip():
    g = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}

    def make():
        return AdapterOptimizer(params, num_training_steps=5, learning_rate=1e-2,
                                lr_scheduler="cosine", warmup_steps=1, weight_decay=0.1)

    first, second = make(), make()
    tensors, config = first.checkpoint_state()
    assert tensors == {} and config["num_completed_steps"] == 0
    for _ in range(2):
        first.add_grads({name: torch.randn(p.shape, generator=g) for name, p in params.items()})
        first.step()
    tensors, config = first.checkpoint_state()
    assert sorted(tensors) == ["a.exp_avg", "a.exp_avg_sq", "b.exp_avg", "b.exp_avg_sq"]
    with torch.no_grad():
        for name, master in second.masters.items():
            master.copy_(first.masters[name])
    second.load_checkpoint_state(tensors, json.loads(json.dumps(config)))
    assert second.num_completed_steps == 2
    grads = {name: torch.randn(p.shape, generator=g) for name, p in params.items()}
    for opt in (first, second):
        opt.add_grads(grads)
        opt.step()
    assert all(torch.equal(first.masters[n], second.masters[n]) for n in params)
    other = AdapterOptimizer(params, num_training_steps=5, learning_rate=1e-2,
                             lr_scheduler="cosine", warmup_steps=1, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"differ in \['weight_decay'\]"):
        other.load_checkpoint_state(tensors, config)


def test_llm_finetune_checkpoint_and_resume_from(smollm2_dir, tmp_path):
    """The offline handle: `job.checkpoint(path)` and `LLM.finetune(..., resume_from=path)`."""
    data = [{"prompt": "Q: 2 + 2 =", "completion": " 4"},
            {"prompt": "The sky is", "completion": " blue."},
            {"prompt": "Opposite of up:", "completion": " down"},
            {"prompt": "Cats say", "completion": " meow."}]
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    hp = {"batch_size": 2, "n_epochs": 1, "learning_rate": 1e-3, "seed": 5}

    def new():
        return LLM(smollm2_dir, enable_lora=True, max_lora_rank=8, max_model_len=64,
                   max_num_batched_tokens=64)

    llm = new()
    job = llm.finetune(data, lora=lora, hyperparameters=hp)
    with pytest.raises(ValueError, match="step boundary"):
        llm.engine.step()
        job.checkpoint(str(tmp_path / "mid"))
    while len(job.losses) < 1:
        llm.engine.step()
    job.checkpoint(str(tmp_path / "step-1"))
    job.wait()
    job.save(str(tmp_path / "uninterrupted"))
    resumed = new().finetune(data, lora=lora, hyperparameters=hp,
                             resume_from=str(tmp_path / "step-1")).wait()
    assert resumed.losses == job.losses and resumed.num_steps == 2
    resumed.save(str(tmp_path / "resumed"))
    ours, ref = load(tmp_path / "resumed"), load(tmp_path / "uninterrupted")
    assert sorted(ours) == sorted(ref) and all(torch.equal(ours[k], ref[k]) for k in ref)

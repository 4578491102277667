"""Length-aware packing of a job's sequences, and several jobs in one engine (CPU, fp32, a tiny
random Llama: 2 layers, hidden 128, GQA 4:2).

- Greedy packing makes first-fit-decreasing bins under a token (and KV-block) capacity.
- Packed, a job of short examples runs in far fewer iterations than one sequence at a time, and
  trains the same adapter: packed, unpacked and an HF transformers + peft + AdamW loop agree.
  The truth is that loop in fp64; the bound is the fine-tuning exactness tests': relative error of the
  weight change over all adapter tensors <= max(1e-4, the fp32 HF loop's own error).
- Two jobs running concurrently in one engine (their windows in the same iterations, with
  inference rows beside them) each end with the adapter that job trains alone.
Packed and unpacked runs, and concurrent and solo runs, differ only in float rounding (gradient
summation order, batch shapes of the GEMMs), which Adam's normalization magnifies where a
gradient is near zero; they must agree within the same 1e-4 (relative error of the weight
change). Measured (2 cores, torch CPU): packed 1.3e-5 and unpacked 2.9e-5 off fp64 where HF fp32
is 1.5e-5 off; packed vs unpacked 1.6e-5, and 4.8e-7 with LoRA dropout (sequence ids given in
start order instead of training order would make that 0.84); concurrent vs alone 3.9e-6 and
8.9e-7.
"""

from __future__ import annotations

import pytest
import torch

from flexserve import LLM, SamplingParams
from flexserve.finetune.data import TrainingData
from flexserve.finetune.hyperparameters import Hyperparameters
from flexserve.finetune.packing import PackItem, pack_items

from _hf_training import train_hf_peft
from _training_data import random_training_data

TARGETS = ["q_proj", "v_proj", "down_proj"]
LENGTHS = [5, 9, 3, 12, 7, 4, 6, 11, 8, 3, 10, 5]  # two steps of six short examples


def greedy(lengths: list[int], capacity: int, block_size: int = 1,
           max_bin_blocks: int | None = None) -> list[list[int]]:
    items = [PackItem("a", n, -(-n // block_size)) for n in lengths]
    return pack_items(items, capacity, max_bin_blocks, time_limit_s=0).bins


def test_greedy_packing_is_first_fit_decreasing():
    # Longest first: 10 opens bin 0, 9 opens bin 1, 5 joins bin 0, 4 and 3 join bin 1.
    assert greedy([10, 3, 5, 4, 9], 16) == [[0, 2], [1, 3, 4]]
    # A sequence over the capacity is a bin of its own; nothing else joins it.
    assert greedy([20, 2, 3], 16) == [[0], [1, 2]]
    assert greedy([4, 4, 4], 16) == [[0, 1, 2]]
    # KV blocks bound a bin too: 5-token sequences take 2 blocks of 4 each.
    assert greedy([5, 5, 5], 16, block_size=4, max_bin_blocks=4) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="capacity"):
        greedy([5], 0)


@pytest.fixture(scope="module")
def model_dir(tiny_config, tiny_checkpoint):
    config = tiny_config("llama", hidden_size=128, intermediate_size=256,
                         max_position_embeddings=128)
    return tiny_checkpoint(config, seed=3)


@pytest.fixture(scope="module")
def init_adapter(model_dir, tmp_path_factory):
    """A PEFT LoRA adapter (r 8, alpha 16) with seeded non-zero A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    path = str(tmp_path_factory.mktemp("init"))
    peft_model.save_pretrained(path)
    return path


def hyperparameters(**lora) -> Hyperparameters:
    return Hyperparameters.from_dict({
        "batch_size": 6, "n_epochs": 1, "shuffle": False, "learning_rate": 1e-3,
        "lr_scheduler": "constant", "max_grad_norm": None,
        "lora": {"r": 8, "alpha": 16, "target_modules": TARGETS, **lora}})


def new_llm(model_dir: str) -> LLM:
    return LLM(model_dir, enable_lora=True, max_lora_rank=8, max_loras=4, max_model_len=64,
               max_num_batched_tokens=64)


def load_adapter(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.double() for k, v in load_file(f"{path}/adapter_model.safetensors").items()}


def train(llm: LLM, jobs: list[tuple[TrainingData, Hyperparameters, str | None]], path,
          pack: bool = True, prompts: list[list[int]] | None = None
          ) -> tuple[list[dict], list[dict], int]:
    """Run the jobs together to the end (with `prompts` generated in the same iterations);
    returns their initial and final adapters and the number of iterations."""
    engine = llm.engine
    states = [engine.add_finetune_job(data, hp, init_adapter_path=init)
              for data, hp, init in jobs]
    initial = []
    for state in states:
        engine.save_finetune_adapter(state.job_id, str(path / f"{state.job_id}-initial"))
        initial.append(load_adapter(path / f"{state.job_id}-initial"))
        if not pack:  # before any step: one sequence at a time
            state.pack_capacity = None
    num_steps = 0
    schedule = engine.scheduler.schedule
    job_ids_per_plan = []

    def recording_schedule():
        plan = schedule()
        job_ids_per_plan.append({w.job_id for w in plan.finetune_windows + plan.backward_windows})
        return plan

    engine.scheduler.schedule = recording_schedule
    if prompts:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4),
                               use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
        assert not all(state.finished for state in states)  # they shared iterations
    while not all(state.finished for state in states):
        engine.step()
        num_steps += 1
    final = []
    for state in states:
        assert state.status.value == "succeeded", state.error
        engine.save_finetune_adapter(state.job_id, str(path / state.job_id))
        final.append(load_adapter(path / state.job_id))
    assert engine.scheduler.kv_cache_usage == 0.0
    if len(states) > 1:  # the jobs' windows shared iterations
        assert sum(len(job_ids) == len(states) for job_ids in job_ids_per_plan) >= 3
    return initial, final, num_steps


def change_error(ours: dict, truth: dict, initial: dict) -> float:
    """Relative error of the weight change (all tensors together) against `truth`'s change."""
    keys = sorted(truth)
    a = torch.cat([(ours[k] - initial[k]).flatten() for k in keys])
    b = torch.cat([(truth[k] - initial[k]).flatten() for k in keys])
    return float((a - b).norm() / b.norm())


def test_packing_is_faster_and_trains_the_same_adapter(model_dir, init_adapter, tmp_path):
    data, hp = random_training_data(LENGTHS, seed=1), hyperparameters()
    (initial,), (packed,), num_packed = train(new_llm(model_dir), [(data, hp, init_adapter)],
                                              tmp_path / "packed")
    _, (unpacked,), num_unpacked = train(new_llm(model_dir), [(data, hp, init_adapter)],
                                         tmp_path / "unpacked", pack=False)
    # 6 examples of 37-45 tokens per step: one bin each, whose forward is one iteration (vs one
    # iteration per sequence), and whose 2 x ~40 backward token-layers take two more.
    assert (num_packed, num_unpacked) == (6, 14)
    steps = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    truth = train_hf_peft(model_dir, init_adapter, data.examples, steps, 1e-3, torch.float64)
    hf32 = train_hf_peft(model_dir, init_adapter, data.examples, steps, 1e-3, torch.float32)
    hf_error = change_error(hf32, truth, initial)
    packed_error = change_error(packed, truth, initial)
    unpacked_error = change_error(unpacked, truth, initial)
    print(f"relative error of the weight change vs fp64: packed {packed_error:.2e}, unpacked "
          f"{unpacked_error:.2e}, HF fp32 {hf_error:.2e}")
    assert packed_error <= max(1e-4, hf_error) and unpacked_error <= max(1e-4, hf_error)
    difference = change_error(packed, unpacked, initial)
    print(f"packed vs unpacked: {difference:.2e}")
    assert difference <= 1e-4
    # With LoRA dropout: masks follow sequence ids, which are training positions packed or not.
    # One step of all 12 examples (83 tokens): FFD bins {12, 11, 10, 9, 8, 7, 6} and the rest,
    # so sequences start out of training order.
    hp = Hyperparameters.from_dict({
        "batch_size": 12, "n_epochs": 2, "shuffle": False, "learning_rate": 1e-3,
        "lora": {"r": 8, "alpha": 16, "dropout": 0.2, "target_modules": TARGETS}})
    (initial,), (packed,), _ = train(new_llm(model_dir), [(data, hp, None)], tmp_path / "pd")
    _, (unpacked,), _ = train(new_llm(model_dir), [(data, hp, None)], tmp_path / "ud", pack=False)
    difference = change_error(packed, unpacked, initial)
    print(f"packed vs unpacked with dropout: {difference:.2e}")
    assert difference <= 1e-4


def test_two_concurrent_jobs_each_train_the_adapter_they_train_alone(model_dir, init_adapter,
                                                                       tmp_path):
    # Different data, shapes, dropout and learning rates: nothing may leak between the jobs.
    job_a = (random_training_data(LENGTHS, seed=1), hyperparameters(), init_adapter)
    job_b = (random_training_data([14, 6, 9, 4, 13, 8, 5, 10], seed=2),
             Hyperparameters.from_dict({
                 "batch_size": 4, "n_epochs": 1, "shuffle": True, "seed": 7,
                 "learning_rate": 3e-3, "lr_scheduler": "linear", "max_grad_norm": 0.5,
                 "lora": {"r": 4, "alpha": 8, "dropout": 0.1,
                          "target_modules": ["k_proj", "o_proj", "gate_proj", "up_proj"]}}),
             None)
    _, (alone_a,), _ = train(new_llm(model_dir), [job_a], tmp_path / "a")
    _, (alone_b,), _ = train(new_llm(model_dir), [job_b], tmp_path / "b")
    initial, together, _ = train(new_llm(model_dir), [job_a, job_b], tmp_path / "together",
                                 prompts=[[1, 2, 3, 4], [9, 8, 7]])
    for alone, mixed, start in zip((alone_a, alone_b), together, initial):
        assert sorted(alone) == sorted(mixed)
        error = change_error(mixed, alone, start)
        print(f"concurrent vs alone: relative difference of the weight change {error:.2e}")
        assert error <= 1e-4

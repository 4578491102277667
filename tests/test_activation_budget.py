"""The activation budget (`flexserve.peft.activation_budget`): which layers get remat chains, the
options that set it, `flexserve finetune-plan`'s per-layer table, and that a job under a budget
trains the adapter the same job trains without one (the gradients of each plan against HF + PEFT:
tests/test_layer_backward.py, case down-up-budget-mixed-plans)."""

from __future__ import annotations

import pytest
import torch

from flexserve import LLM
from flexserve.config import FinetuneConfig
from flexserve.entrypoints.cli.finetune_plan import main as finetune_plan_main
from flexserve.finetune.data import TrainingData, TrainingExample
from flexserve.finetune.hyperparameters import Hyperparameters
from flexserve.model.registry import resolve_model
from flexserve.peft.activation_budget import (
    GIB,
    NUM_SLOTS,
    plan_job_layers,
    plan_layers,
)
from flexserve.peft.graph_pruning import plan_pruning
from flexserve.peft.layer_graph import build_layer_graph

TOKENS = 4096
BASE, LEAN, LAYER0 = 81_920, 16_384, 28_672  # Llama-3.1-8B, LoRA r=16 on down_proj, bf16


@pytest.fixture(scope="module")
def llama8b():
    return resolve_model("llama-3.1-8b").hf_config


def test_without_a_budget_only_layer0_differs(llama8b):
    graph = build_layer_graph(llama8b, {"down_proj": "lora"}, rank=16)
    layers = plan_layers(graph, 2, 32, max_num_tokens=TOKENS)
    assert layers.lean_layers == () and layers.budget_bytes is None
    assert layers.plans[0] == plan_pruning(graph, 2, input_grad=False)  # keeps m alone
    assert all(plan == plan_pruning(graph, 2) for plan in layers.plans[1:])
    assert [p.bytes_per_token for p in layers.plans[:2]] == [LAYER0, BASE]
    assert layers.num_bytes == TOKENS * (LAYER0 + 31 * BASE) == 10_519_314_432
    kept = plan_layers(graph, 2, 32, layer0_input_grad=True)
    assert kept.plans[0] == kept.plans[1] and kept.num_bytes is None


@pytest.mark.parametrize("budget_gib, num_lean", [
    (9.8, 0), (7.0, 12), (6.0, 16), (5.5, 18), (5.0, 20), (2.1, 31)])
def test_budget_chains_as_few_of_the_lowest_layers_as_fit(llama8b, budget_gib, num_lean):
    layers = plan_job_layers(llama8b, ["down_proj"], 16, 0.0, 2, budget_gib=budget_gib,
                             max_num_tokens=TOKENS)
    assert layers.lean_layers == tuple(range(1, num_lean + 1))  # layer 0 gains nothing
    assert layers.bytes_per_token == LAYER0 + num_lean * LEAN + (31 - num_lean) * BASE
    assert layers.num_bytes <= budget_gib * GIB < layers.num_bytes + (BASE - LEAN) * TOKENS
    for layer in range(1, 32):
        plan = layers.plans[layer]
        if layer <= num_lean:
            assert plan.chains and plan.remat_threshold == 0.6
            assert plan.stored == {"x", "x_mid"}
        else:
            assert not plan.chains and plan.remat_threshold == 0.01
            assert plan.stored == {"x", "x_mid", "q", "gate_out", "up_out"}


def test_a_configured_threshold_sets_the_lean_plan(llama8b):
    graph = build_layer_graph(llama8b, {"down_proj": "lora"}, rank=16)
    # 0.1 with chains recomputes q alone (7.7% of the layer's FLOPs): 8 KiB per token saved
    budget = (LAYER0 + 31 * BASE - 3 * 8192) * TOKENS
    layers = plan_layers(graph, 2, 32, 0.1, budget_bytes=budget, max_num_tokens=TOKENS)
    assert layers.lean_layers == (1, 2, 3) and layers.num_bytes == budget
    assert layers.plans[1].stored == {"x", "x_mid", "gate_out", "up_out"}
    assert (layers.base_threshold, layers.lean_threshold) == (0.1, 0.1)


def test_impossible_budgets_and_bad_arguments_are_refused(llama8b):
    # every layer lean, layer 0 too: x and x_mid (m recomputed) instead of m
    assert plan_job_layers(llama8b, ["down_proj"], 16, 0.0, 2, budget_gib=2.0,
                           max_num_tokens=TOKENS).lean_layers == tuple(range(32))
    with pytest.raises(ValueError, match=r"1.9 GiB cannot hold a 4096-token sequence: even "
                                         r"with remat chains at threshold 0.6 in every layer it "
                                         r"needs 2 GiB \(524,288 B per token over 32 layers\)"):
        plan_job_layers(llama8b, ["down_proj"], 16, 0.0, 2, budget_gib=1.9,
                        max_num_tokens=TOKENS)
    with pytest.raises(ValueError, match="5.42 GiB"):  # all seven: o_proj's input stays stored
        plan_job_layers(llama8b, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                  "up_proj", "down_proj"], 16, 0.0, 2, budget_gib=5.0,
                        max_num_tokens=TOKENS)
    graph = build_layer_graph(llama8b, {"down_proj": "lora"}, rank=16)
    with pytest.raises(ValueError, match="needs max_num_tokens"):
        plan_layers(graph, 2, 32, budget_bytes=GIB)
    for budget in (0, -5, True, 1.5):
        with pytest.raises(ValueError, match="positive number of bytes"):
            plan_layers(graph, 2, 32, budget_bytes=budget, max_num_tokens=TOKENS)
    with pytest.raises(ValueError, match="max_num_tokens"):
        plan_layers(graph, 2, 32, max_num_tokens=0)


def test_config_and_serve_option():
    from flexserve.entrypoints.cli.args import engine_config_from_args
    from flexserve.entrypoints.cli.main import build_parser

    assert FinetuneConfig().activation_budget_gib is None
    assert FinetuneConfig(activation_budget_gib=5.5).activation_budget_gib == 5.5
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="activation_budget_gib"):
            FinetuneConfig(activation_budget_gib=bad)
    args = build_parser().parse_args(["serve", "--finetune-activation-budget", "6.25"])
    assert engine_config_from_args(args).finetune.activation_budget_gib == 6.25
    args = build_parser().parse_args(["serve", "--finetune-activation-budget", "0"])
    with pytest.raises(ValueError, match="activation_budget_gib"):
        engine_config_from_args(args)


def test_finetune_plan_prints_the_mix(capsys):
    argv = ["--model", "llama-3.1-8b", "--targets", "down_proj", "--no-autograd",
            "--max-finetune-len", "4096"]
    assert finetune_plan_main(argv + ["--finetune-activation-budget", "5.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(x for x in lines if x.startswith("activation budget"))):]
    assert table[0] == ("activation budget 5.5 GiB for one 4096-token sequence: 18 of 32 layers "
                        "with remat chains at threshold 0.6 (the lowest ones)")
    rows = [line.split() for line in table[2:]]
    assert rows[0][0] == "0" and rows[0][-3:] == ["28,672", "0.109", "m"]
    assert rows[1][:4] == ["1-18", "chains,", "threshold", "0.6"]
    assert rows[1][-4:] == ["16,384", "1.125", "x,", "x_mid"]
    assert rows[2][0] == "19-31" and rows[2][-7:-5] == ["81,920", "4.062"]
    assert rows[3][:3] == ["total", "1,388,544", "5.297"]
    assert finetune_plan_main(argv) == 0  # no budget: every layer as planned
    assert "19-31" not in capsys.readouterr().out
    for extra, message in ((["--finetune-activation-budget", "1"], "cannot hold"),
                           (["--finetune-activation-budget", "-1"], "positive number")):
        with pytest.raises(SystemExit) as exit_info:
            finetune_plan_main(argv + extra)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        finetune_plan_main(argv[:-2] + ["--finetune-activation-budget", "5"])
    assert "needs --max-finetune-len" in capsys.readouterr().err


# ------------------------------------------------------------------ a job under a budget
TARGETS = ["gate_proj", "up_proj", "down_proj"]
SEQ_LEN = 40


def new_llm(model_dir: str, budget_gib: float | None, offload: bool = False) -> LLM:
    # fp32 on CUDA too (the plans below assume 4-byte activations); no start-up warm-up job
    # (CUDA): it trains max_model_len-token sequences, which budgets sized for SEQ_LEN cannot hold.
    return LLM(model_dir, dtype="float32", enable_lora=True, max_lora_rank=8, max_model_len=64,
               max_num_batched_tokens=64, activation_budget_gib=budget_gib,
               activation_offload=offload, warmup=False)


def job_inputs() -> tuple[TrainingData, Hyperparameters]:
    g = torch.Generator().manual_seed(3)
    examples = [TrainingExample(i + 1, torch.randint(0, 256, (SEQ_LEN,), generator=g).tolist(),
                                [False] + [True] * (SEQ_LEN - 1)) for i in range(2)]
    data = TrainingData("text", examples, [], 2 * SEQ_LEN, 2 * (SEQ_LEN - 1))
    hp = Hyperparameters.from_dict({
        "batch_size": 2, "n_epochs": 1, "shuffle": False, "learning_rate": 1e-2, "seed": 5,
        "lr_scheduler": "constant", "max_grad_norm": None, "max_seq_len": SEQ_LEN,
        "lora": {"r": 8, "alpha": 16, "target_modules": TARGETS}})
    return data, hp


def train_one_step(model_dir: str, budget_gib: float | None, offload: bool = False):
    """(the job's LayerPlans, its adapter weights after one optimizer step)."""
    engine = new_llm(model_dir, budget_gib, offload).engine
    state = engine.add_finetune_job(*job_inputs())
    job = engine.executor.finetune_runner.jobs[state.job_id]
    while not state.finished:
        engine.step()
    assert state.status.value == "succeeded", state.error
    return job.layer_plans, job.adapter().weights


def test_a_job_under_a_budget_trains_the_same_adapter(tiny_config, tiny_checkpoint):
    config = tiny_config("llama", num_hidden_layers=3, max_position_embeddings=128)
    model_dir = tiny_checkpoint(config, seed=7)
    free, expected = train_one_step(model_dir, None)
    graph = build_layer_graph(config, dict.fromkeys(TARGETS, "lora"), rank=8)
    lean = plan_pruning(graph, 4, 0.6, chains=True)  # fp32 on the CPU
    saving = free.plans[1].bytes_per_token - lean.bytes_per_token
    layer0_lean = min(plan_pruning(graph, 4, 0.6, input_grad=False, chains=True), lean,
                      key=lambda p: p.bytes_per_token)
    assert free.lean_layers == () and not free.plans[0].input_grad
    assert saving > free.plans[0].bytes_per_token - layer0_lean.bytes_per_token
    budget_gib = ((free.bytes_per_token - saving) * SEQ_LEN + 0.5) / GIB
    mixed, weights = train_one_step(model_dir, budget_gib)
    assert mixed.lean_layers == (1,) and mixed.max_num_tokens == SEQ_LEN
    assert list(mixed.plans) == [free.plans[0], lean, free.plans[2]]
    worst = 0.0
    for key, (a, b) in expected.items():
        for ours, theirs in zip(weights[key], (a, b)):
            worst = max(worst, ((ours - theirs).norm() / theirs.norm()).item())
    assert worst <= 1e-5, worst  # fp32 rounding of recomputed vs stored tensors only
    engine = new_llm(model_dir, budget_gib / 100).engine
    with pytest.raises(ValueError, match="cannot hold a 40-token sequence"):
        engine.add_finetune_job(*job_inputs())
    assert engine.scheduler.adapter_manager.num_resident == 0  # the slot was given back
    assert not engine.scheduler.finetune.jobs


# ------------------------------------------------------------------- offload to host memory
def test_offload_takes_every_other_layer_before_any_goes_lean(llama8b):
    graph = build_layer_graph(llama8b, {"down_proj": "lora"}, rank=16)
    full = LAYER0 + 31 * BASE
    # Each offloaded layer saves BASE bytes per token; the ring costs NUM_SLOTS layers once.
    for count in (3, 8, 13, 16):
        budget = (full - count * BASE + NUM_SLOTS * BASE) * TOKENS
        layers = plan_layers(graph, 2, 32, budget_bytes=budget, max_num_tokens=TOKENS,
                             offload=True)
        assert layers.offload_layers == tuple(range(1, 2 * count, 2)), count
        assert layers.lean_layers == () and layers.num_bytes == budget
        assert layers.host_bytes_per_token == count * BASE
        assert layers.device_bytes_per_token == full - count * BASE + NUM_SLOTS * BASE
        assert layers.bytes_per_token == full  # every plan as without the budget
        fewer = plan_layers(graph, 2, 32, budget_bytes=budget - 1, max_num_tokens=TOKENS,
                            offload=True)
        assert len(fewer.offload_layers) == count + 1 or fewer.lean_layers  # minimal
    # Past all 16 odd layers, the even ones go lean, the largest saving (not layer 0) first.
    budget = (full - 16 * BASE + NUM_SLOTS * BASE - 3 * (BASE - LEAN)) * TOKENS
    layers = plan_layers(graph, 2, 32, budget_bytes=budget, max_num_tokens=TOKENS, offload=True)
    assert layers.offload_layers == tuple(range(1, 32, 2))
    assert layers.lean_layers == (2, 4, 6) and layers.num_bytes == budget
    # No budget, or one the store fits: nothing moves.
    assert plan_layers(graph, 2, 32, max_num_tokens=TOKENS, offload=True).offload_layers == ()
    assert plan_layers(graph, 2, 32, budget_bytes=full * TOKENS, max_num_tokens=TOKENS,
                       offload=True).offload_layers == ()
    with pytest.raises(ValueError, match="16 layers in host memory"):
        plan_layers(graph, 2, 32, budget_bytes=GIB, max_num_tokens=TOKENS, offload=True)


def test_offload_options(capsys):
    from flexserve.entrypoints.cli.args import engine_config_from_args
    from flexserve.entrypoints.cli.main import build_parser

    assert FinetuneConfig().activation_offload is False
    args = build_parser().parse_args(["serve", "--finetune-activation-budget", "6.6",
                                      "--finetune-activation-offload"])
    assert engine_config_from_args(args).finetune.activation_offload is True
    argv = ["--model", "llama-3.1-8b", "--targets", "down_proj", "--no-autograd",
            "--max-finetune-len", "4096", "--finetune-activation-budget", "6.6",
            "--finetune-activation-offload"]
    assert finetune_plan_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(x for x in lines if x.startswith("activation budget"))):]
    assert table[0] == ("activation budget 6.6 GiB for one 4096-token sequence: 13 of 32 layers "
                        "in pinned host memory (every other from layer 1), 0 with remat chains "
                        "at threshold 0.6")
    rows = [line.split() for line in table[2:]]
    assert rows[2][:7] == ["offload", "in", "pinned", "host", "memory:", "layers", "1,"]
    assert rows[2][-3:] == ["25", "-1,064,960", "-4.062"]
    assert rows[3][0] == "ring" and rows[3][-2:] == ["163,840", "0.625"]
    assert rows[4][:4] == ["on", "device", "1,667,072", "6.359"]
    with pytest.raises(SystemExit):
        finetune_plan_main(argv[:-3] + ["--finetune-activation-offload"])
    assert "needs --finetune-activation-budget" in capsys.readouterr().err


def test_a_job_with_offloaded_layers_trains_the_same_adapter(tiny_config, tiny_checkpoint):
    """Offloaded rows come back exactly, so the adapter is the same: to the bit on the CPU; on
    CUDA within 1e-6 (the attention backward's atomics may sum in another order)."""
    config = tiny_config("llama", num_hidden_layers=6, max_position_embeddings=128)
    model_dir = tiny_checkpoint(config, seed=8)
    free, expected = train_one_step(model_dir, None)
    layer = free.plans[1].bytes_per_token
    budget_gib = ((free.bytes_per_token - layer) * SEQ_LEN + 0.5) / GIB  # 3 offloaded, 2 slots
    plans, weights = train_one_step(model_dir, budget_gib, offload=True)
    assert plans.offload_layers == (1, 3, 5) and plans.lean_layers == ()
    assert plans.plans == free.plans
    for key, pair in expected.items():
        for ours, theirs in zip(weights[key], pair):
            if torch.cuda.is_available():
                assert ((ours - theirs).norm() / theirs.norm()).item() <= 1e-6, key
            else:
                assert torch.equal(ours, theirs), key

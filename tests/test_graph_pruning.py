"""Graph pruning (FlexLLM algorithm 1) on Llama-3.1-8B-shaped layer graphs: the exact sets each
bypass configuration stores, keeps in the KV cache, rematerializes and compresses; that every plan
is valid (all the backward reads is stored, in the KV cache, or recomputable from those); the
measured full-autograd baseline on a tiny layer; and the `finetune-plan` command's output."""

from __future__ import annotations

import math

import pytest

from flexserve.entrypoints.cli import finetune_plan
from flexserve.entrypoints.cli import main as cli
from flexserve.model.registry import resolve_model
from flexserve.peft.bypass import TARGET_MODULES
from flexserve.peft.graph_pruning import (
    PruningPlan,
    backward_rule,
    fold_lora_dropout,
    full_autograd_bytes_per_token,
    plan_pruning,
)
from flexserve.peft.layer_graph import LayerGraph, Op, build_layer_graph

ALL = tuple(TARGET_MODULES)
ATTN_IN = ("q_proj", "k_proj", "v_proj")
H, KV, INTER = 4096, 1024, 14336  # Llama-3.1-8B: hidden, K/V width, intermediate
# What every layer above layer 0 needs whatever the bypass: rmsnorm inputs, attention's q (k and
# v_out in the KV cache) and silu_mul's inputs. Backward recomputes the rest of the backbone.
BASE_STORED = {"x", "x_mid", "q", "gate_out", "up_out"}
BASE_BYTES = (3 * H + 2 * INTER) * 2  # bf16


@pytest.fixture(scope="module")
def llama8b():
    return resolve_model("llama-3.1-8b").hf_config


def plan(config, bypass, dropout=0.0, rank=16, dtype_bytes=2, **kwargs) -> PruningPlan:
    return plan_pruning(build_layer_graph(config, bypass, rank=rank, dropout=dropout),
                        dtype_bytes, **kwargs)


def test_lora_on_down_proj_only(llama8b):
    p = plan(llama8b, {"down_proj": "lora"})
    assert p.stored == BASE_STORED
    assert p.kv_cache == {"k", "v_out"}
    assert p.remat_order == ("m", "down_proj_s")  # m = silu(gate) * up, s = m A^T
    assert p.compressed == {}
    assert p.bytes_per_token == BASE_BYTES == 81920
    by_name = {t.name: t for t in p.tensors}
    assert by_name["m"].recompute_from == ("gate_out", "up_out")
    assert by_name["m"].recompute_flops == 5 * INTER
    assert by_name["down_proj_s"].recompute_flops == 5 * INTER + 2 * INTER * 16  # the chain, in full
    assert by_name["x"].needed_by == ("input_layernorm",)
    # Only backbone weight gradients go: every op still propagates to x.
    assert p.backward["down_proj.linear"] == ("m",)
    assert set(p.backward["down_proj.lora_b"]) == {"down_proj_s", "down_proj.lora_B"}
    assert p.backward["input_layernorm"] == ("x",)
    # Without pruning, full fine-tuning would also keep h_attn, attn, h_mlp, m and s.
    assert p.unpruned_bytes_per_token == (6 * H + 3 * INTER + 16) * 2


def test_layer0_pruning_propagates_through_the_layer(llama8b):
    """Nothing below layer 0 trains: removing grad(x) empties every backward op off the path
    from the output to the LoRA weights, so only the LoRA input is kept."""
    p = plan(llama8b, {"down_proj": "lora"}, input_grad=False)
    assert p.stored == {"m"} and p.kv_cache == set() and p.remat_order == ("down_proj_s",)
    assert p.bytes_per_token == INTER * 2
    live = {op: outs for op, outs in p.backward.items() if outs}
    assert live == {"down_proj.lora_a": ("down_proj.lora_A",),
                    "down_proj.lora_b": ("down_proj_s", "down_proj.lora_B"),
                    "down_proj.add": ("down_proj_delta",), "mlp_residual": ("down_out",)}


def test_lora_on_all_seven_linears(llama8b):
    p = plan(llama8b, dict.fromkeys(ALL, "lora"))
    assert p.stored == BASE_STORED | {"attn"}  # o_proj's LoRA input; attention is never redone
    assert p.kv_cache == {"k", "v_out"}
    assert p.remat_order == ("h_attn", "q_proj_s", "k_proj_s", "v_proj_s", "o_proj_s", "h_mlp",
                             "gate_proj_s", "up_proj_s", "m", "down_proj_s")
    assert p.bytes_per_token == BASE_BYTES + H * 2 == 90112
    by_name = {t.name: t for t in p.tensors}
    assert by_name["h_attn"].recompute_from == ("x",)
    assert by_name["q_proj_s"].recompute_from == ("h_attn",)
    assert by_name["q_proj_s"].recompute_flops == 4 * H + 2 * H * 16
    p0 = plan(llama8b, dict.fromkeys(ALL, "lora"), input_grad=False)
    assert p0.stored == (p.stored - {"x"}) | {"h_attn"}  # x was kept for rmsnorm's dx only


def test_chains_beyond_algorithm_1_trade_memory_for_recompute(llama8b):
    # Off by default: the threshold alone cannot reach gate_out (its input h_mlp is not in A).
    assert plan(llama8b, {"down_proj": "lora"}, remat_threshold=0.6).stored == BASE_STORED
    p = plan(llama8b, {"down_proj": "lora"}, remat_threshold=0.6, chains=True)
    assert p.chains and p.stored == {"x", "x_mid"}
    assert p.bytes_per_token == 2 * H * 2 == 16384
    assert p.remat_order == ("h_attn", "q_out", "q", "h_mlp", "gate_out", "up_out", "m", "down_proj_s")
    by_name = {t.name: t for t in p.tensors}
    assert by_name["h_mlp"].needed_by == () and by_name["h_mlp"].recompute_from == ("x_mid",)
    # A chain is paid in full: m = silu_mul(gate_out, up_out), each from h_mlp from x_mid.
    gate = by_name["gate_out"].recompute_flops
    assert by_name["m"].recompute_flops == 2 * gate + 5 * INTER  # silu_mul: 5 FLOPs per element
    # Below the chain's price gate/up stay stored (each costs 26.9% of the layer's forward FLOPs).
    p = plan(llama8b, {"down_proj": "lora"}, remat_threshold=0.25, chains=True)
    assert {"gate_out", "up_out", "x", "x_mid"} <= p.stored and "q" not in p.stored


@pytest.mark.parametrize("targets", [("down_proj",), ALL])
@pytest.mark.parametrize("input_grad", [True, False])
def test_lora_dropout_is_planned_folded_into_lora_a(llama8b, targets, input_grad):
    # The dropout mask is regenerated from its seed, so each dropout folds into its LoRA A (which
    # then reads the dropout's input): with dropout the plan is exactly the plan without it, no
    # mask and no dropout output kept, at every layer.
    bypass = dict.fromkeys(targets, "lora")
    with_dropout = plan(llama8b, bypass, dropout=0.1, input_grad=input_grad)
    without = plan(llama8b, bypass, input_grad=input_grad)
    for field in ("stored", "kv_cache", "rematerialized", "compressed", "bytes_per_token", "tensors", "backward"):
        assert getattr(with_dropout, field) == getattr(without, field), field
    assert not any(name.endswith(("_xd", "_mask")) for t in with_dropout.tensors for name in (t.name, *t.needed_by))
    # All seven projections: 90,112 bytes per token and layer (before the fold, with each mask a
    # bitmask and each dropout output stored: 164,608).
    if targets == ALL and input_grad:
        assert with_dropout.bytes_per_token == 90112
        assert with_dropout.remat_order[0] == "h_attn" and "attn" in with_dropout.stored


def test_fold_lora_dropout(llama8b):
    graph = build_layer_graph(llama8b, dict.fromkeys(ALL, "lora"), 16, 0.1)
    folded = fold_lora_dropout(graph)
    assert [op.name for op in folded.ops] == [op.name for op in graph.ops if op.kind != "dropout"]
    src = {"q_proj": "h_attn", "o_proj": "attn", "up_proj": "h_mlp", "down_proj": "m"}
    for target, name in src.items():
        assert next(op for op in folded.ops if op.name == f"{target}.lora_a").inputs == (name,)
    assert set(graph.tensors) - set(folded.tensors) == {f"{t}_{s}" for t in ALL for s in ("xd", "mask")}
    no_dropout = build_layer_graph(llama8b, dict.fromkeys(ALL, "lora"), 16, 0.0)
    assert fold_lora_dropout(no_dropout) is no_dropout and folded.ops == no_dropout.ops


def test_ia3_peft_default(llama8b):
    """PEFT's Llama default: k_proj and v_proj outputs scaled, down_proj's input scaled."""
    p = plan(llama8b, {"k_proj": "ia3", "v_proj": "ia3", "down_proj": "ia3"})
    # dl reads the tensor it scales: k/v before scaling, m (recomputed) for down_proj.
    assert p.stored == BASE_STORED | {"k_proj_base", "v_proj_base"}
    assert p.kv_cache == {"k", "v_out"}
    assert p.remat_order == ("m",)
    assert p.compressed == {}
    assert p.bytes_per_token == BASE_BYTES + 2 * KV * 2 == 86016
    assert p.backward["down_proj.ia3"] == ("m", "down_proj.ia3_l")


@pytest.mark.parametrize("bypass, dropout", [
    ({"down_proj": "lora"}, 0.0), (dict.fromkeys(ALL, "lora"), 0.0),
    (dict.fromkeys(ALL, "lora"), 0.2), ({"q_proj": "ia3", "o_proj": "ia3", "up_proj": "ia3"}, 0.0),
    ({"v_proj": "lora", "gate_proj": "ia3", "down_proj": "ia3"}, 0.0),
])
@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_bytes_per_token_is_the_sum_of_widths(llama8b, bypass, dropout, dtype_bytes):
    graph = build_layer_graph(llama8b, bypass, rank=8, dropout=dropout)
    for input_grad in (True, False):
        p = plan_pruning(graph, dtype_bytes, input_grad=input_grad)
        expected = sum(math.ceil(graph.tensors[t].width / 8) if t in p.compressed
                       else graph.tensors[t].width * dtype_bytes for t in p.stored)
        assert p.bytes_per_token == expected == sum(t.bytes_per_token for t in p.tensors)
        assert all(graph.tensors[t].dtype == "bool" for t in p.compressed)


def test_threshold_zero_rematerializes_nothing_and_attention_is_never_redone(llama8b):
    bypass = dict.fromkeys(ALL, "lora")
    none = plan(llama8b, bypass, remat_threshold=0.0)
    default = plan(llama8b, bypass)
    assert none.rematerialized == set()
    assert none.stored == default.stored | default.rematerialized
    assert none.bytes_per_token == default.bytes_per_token + (2 * H + INTER + 7 * 16) * 2  # h_*, m, s
    # Any budget: attention's cost grows with the context, frozen GEMMs only with a big budget.
    huge = plan(llama8b, {"up_proj": "lora"}, remat_threshold=1.0)
    assert "gate_out" in huge.rematerialized  # gate_proj(h_mlp), 27% of the layer's FLOPs
    assert "gate_out" in plan(llama8b, {"up_proj": "lora"}).stored
    assert "attn" in plan(llama8b, bypass, remat_threshold=1e9).stored
    with pytest.raises(ValueError, match="remat_threshold"):
        plan(llama8b, bypass, remat_threshold=-0.1)
    with pytest.raises(ValueError, match="dtype_bytes"):
        plan(llama8b, bypass, dtype_bytes=0)


def _check_valid(graph: LayerGraph, p: PruningPlan) -> None:
    """Independent of the pass: what the kept gradients read (by the rules) is available, and
    every rematerialized tensor is recomputable from earlier available tensors (in the graph the
    pass plans: its LoRA dropout folded)."""
    graph = fold_lora_dropout(graph)
    order = ["x"] + [t for op in graph.ops for t in op.outputs]
    ops = {op.name: op for op in graph.ops}
    available = p.stored | p.kv_cache | p.rematerialized
    read = set()
    for name, outputs in p.backward.items():
        for wrt in outputs:
            read |= backward_rule(ops[name], wrt)
    assert read == {t.name for t in p.tensors}  # A is exactly what the kept backward reads
    assert read <= available
    assert not p.stored & p.kv_cache and not p.rematerialized & (p.stored | p.kv_cache)
    assert all(graph.tensors[t].storage == "kv_cache" for t in p.kv_cache)
    for t in p.tensors:
        if t.status != "rematerialized":
            assert t.recompute_from == ()
            continue
        producer = graph.producer(t.name)
        assert t.recompute_from == producer.inputs
        assert producer.kind != "attention"
        for source in t.recompute_from:
            assert source in available
            assert order.index(source) < order.index(t.name)
        assert t.recompute_flops < p.remat_threshold * p.layer_flops_per_token
    # Trainable parameters always get their gradient; with input_grad every input gradient too.
    for op in graph.ops:
        assert set(op.trainable) <= set(p.backward[op.name])
        if p.input_grad:
            assert set(p.backward[op.name]) == set(op.inputs) | set(op.trainable)


@pytest.mark.parametrize("kind", ["lora", "ia3"])
@pytest.mark.parametrize("targets", [("down_proj",), ("o_proj",), ATTN_IN, ALL,
                                     ("k_proj", "up_proj")])
def test_every_plan_is_valid(llama8b, tiny_config, kind, targets):
    for config in (llama8b, tiny_config("llama")):
        for dropout in ((0.0, 0.1) if kind == "lora" else (0.0,)):
            graph = build_layer_graph(config, dict.fromkeys(targets, kind), 4, dropout)
            for threshold in (0.0, 0.01, 0.3, 1e9):
                for input_grad in (True, False):
                    _check_valid(graph, plan_pruning(graph, 2, threshold, input_grad))


def test_backward_rules():
    linear = Op("p.linear", "linear", ("a",), ("b",))
    assert backward_rule(linear, "a") == set() and backward_rule(linear, "p.linear.weight") == {"a"}
    lora_a = Op("p.lora_a", "lora_a", ("a",), ("s",), ("p.lora_A",))
    assert backward_rule(lora_a, "p.lora_A") == {"a"} and backward_rule(lora_a, "a") == set()
    silu = Op("silu_mul", "silu_mul", ("g", "u"), ("m",))
    assert backward_rule(silu, "g") == {"g", "u"} and backward_rule(silu, "u") == {"g"}
    # LoRA dropout has no rule of its own: the pass folds it into LoRA A (`fold_lora_dropout`).
    with pytest.raises(ValueError, match="no backward rule for op kind 'dropout'"):
        backward_rule(Op("p.dropout", "dropout", ("a",), ("xd", "mask")), "a")
    attention = Op("attention", "attention", ("q", "k", "v"), ("o",))
    assert backward_rule(attention, "k") == {"q", "k", "v"}
    assert backward_rule(Op("rope_q", "rope", ("a",), ("b",)), "a") == set()
    assert backward_rule(Op("n", "rmsnorm", ("a",), ("b",)), "a") == {"a"}
    with pytest.raises(ValueError, match="no backward rule for op kind 'gelu'"):
        backward_rule(Op("act", "gelu", ("a",), ("b",)), "a")


def test_full_autograd_measured_on_a_tiny_layer(tiny_config):
    """fp32, hidden 64, 4 heads x 16 (2 KV heads), intermediate 128, LoRA r=16 on down_proj."""
    config = tiny_config("llama")
    bypass = {"down_proj": "lora"}
    measured = full_autograd_bytes_per_token(config, bypass, "float32")
    # RMSNorm: x and 1/rms (twice); SDPA: q, k, v, out, logsumexp per head; silu(gate) * up:
    # gate, silu(gate), up; LoRA A: its input m; LoRA B: s.
    floats = (64 + 1) * 2 + 64 + 32 + 32 + 64 + 4 + 3 * 128 + 128 + 16
    assert measured == floats * 4 == 3416
    # Layer 0 (input needs no grad): autograd itself keeps only the LoRA branch.
    assert full_autograd_bytes_per_token(config, bypass, "float32", input_grad=False) == 576
    # Full fine-tuning also keeps both RMSNorms' normalized inputs (for their weights) and the
    # q/k/v and gate/up inputs h_attn, h_mlp (attn shares SDPA's output, m is kept already).
    trainable = full_autograd_bytes_per_token(config, bypass, "float32", frozen_backbone=False)
    assert trainable == 3416 + 4 * 64 * 4
    # Ours: x, q, x_mid, gate_out, up_out, and s (at these widths its chain m -> s costs 5.8% of
    # the layer's FLOPs, over the 1% budget; m itself is redone).
    ours = plan_pruning(build_layer_graph(config, bypass), 4).bytes_per_token
    assert ours == (3 * 64 + 2 * 128 + 16) * 4 == 1856
    assert 1 - ours / measured == pytest.approx(0.4567, abs=1e-4)
    # Dropout: LoRA A keeps the dropped m instead of m, plus a 1-byte mask (CUDA's dropout, which
    # the probe uses on the CPU too); (IA)3 on k_proj keeps k_proj's unscaled output.
    with_dropout = full_autograd_bytes_per_token(config, bypass, "float32", dropout=0.1)
    assert with_dropout == 3416 + 128
    assert full_autograd_bytes_per_token(config, {**bypass, "k_proj": "ia3"}, "float32") == \
        3416 + 32 * 4
    with pytest.raises(ValueError, match="unknown dtype"):
        full_autograd_bytes_per_token(config, bypass, "int8")


@pytest.fixture
def tiny_model_dir(tiny_config, tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    return str(tmp_path)


def test_cli_prints_the_table(tiny_model_dir, capsys):
    assert finetune_plan.main(["--model", tiny_model_dir, "--targets", "down_proj",
                               "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "LoRA r=16, dropout 0 on down_proj | dtype float32" in out
    assert "layer 1 (the gradient of x is needed)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].islower()}
    assert rows["gate_out"][:4] == ["gate_out", "128", "stored", "512"]
    assert rows["k"][:5] == ["k", "32", "kv", "cache", "0"]
    assert rows["down_proj_s"][:4] == ["down_proj_s", "16", "stored", "64"]
    assert "total 1,856 B/token/layer" in out
    assert "full autograd (measured): 3,416 B/token/layer with the backbone frozen, 4,440 B" in out
    assert "reduction: 45.7% vs autograd with the backbone frozen, 58.2% vs trainable" in out
    # Layer 0 keeps the LoRA branch only (m and s), as autograd does.
    assert "total 576 B/token/layer" in out.split("layer 0 (")[1]
    model_row = [line for line in out.splitlines() if line.startswith("model ")][1].split()
    assert model_row[1:4] == ["2,432", "3,992", "39.1%"]  # 576 + 1856 vs 576 + 3416


def test_cli_shipped_architecture_without_weights(capsys):
    assert cli.main(["finetune-plan", "--model", "llama-3.1-8b", "--bypass", "ia3",
                     "--no-autograd", "--num-layers-shown", "2"]) == 0
    out = capsys.readouterr().out
    assert "(IA)3 on k_proj, v_proj, down_proj | dtype bfloat16" in out
    assert "k_proj_base" in out and "total 86,016 B/token/layer" in out
    assert "... layers 2-31: as layer 1" in out
    assert "full autograd" not in out
    # Something trainable below layer 0: every layer keeps its input gradient and the same plan.
    assert finetune_plan.main(["--model", "llama-3.1-8b", "--targets", "down_proj",
                               "--no-autograd", "--layer0-input-grad"]) == 0
    out = capsys.readouterr().out
    assert "every layer (the gradient of x is needed)" in out and "layer 0 (" not in out
    assert f"{32 * 81920:,}" in out.splitlines()[-1]


@pytest.mark.parametrize("args, message", [
    (["--targets", "q_proj,lm_head"], "unknown target module(s) 'lm_head'"),
    (["--bypass", "prefix"], "unknown --bypass 'prefix'; known: lora, ia3"),
    (["--bypass", "ia3", "--dropout", "0.1"], "--dropout applies to LoRA only"),
    (["--rank", "0"], "--rank must be >= 1"),
    (["--dtype", "int8"], "unknown --dtype 'int8'"),
    (["--remat-threshold", "-1"], "--remat-threshold must be a finite number >= 0"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_cli_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        finetune_plan.main(["--model", "llama-3.1-8b", "--no-autograd", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

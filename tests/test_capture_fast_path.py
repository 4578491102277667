"""The fast paths of fine-tuning forward windows: `use_triton`'s cache follows the environment,
the capture's precomputed (layer, name) -> windows table writes exactly what each window's plan
keeps (two jobs with different plans in one step, inference rows around them), the merged-GEMM
captured forward gives what the per-projection one gives, and the captured layers' inference-mode
outputs never reach the stores as inference tensors."""

from __future__ import annotations

import math

import pytest
import torch

from flexserve.config import ModelConfig
from flexserve.layers.attention import AttentionMetadata
from flexserve.layers.forward_context import set_forward_context
from flexserve.model.loader import load_model
from flexserve.model.registry import resolve_model
from flexserve.peft.bypass import TARGET_MODULES
from flexserve.peft.graph_pruning import plan_pruning
from flexserve.peft.layer_graph import build_layer_graph
from flexserve.worker.finetune.activation_store import (
    ActivationStore,
    FinetuneCapture,
    apply_lora_dropout,
    dropout_keep_mask,
)
from flexserve.worker.lora_manager import attach_lora_linears
from flexserve_kernels.dispatch import use_triton
from flexserve_kernels.lora.serve.meta import LoRAKernelMeta

BLOCK_SIZE = 4
MAX_LORAS, MAX_RANK = 3, 8
NUM_LAYERS = 3
# slot 0: job A (down_proj, pruned plan); slot 1: job B (q/v/gate with dropout, every tensor
# kept); slot 2: a served adapter on o_proj for an inference row
JOB_A, JOB_B, SERVED = 0, 1, 2
TARGETS_A, TARGETS_B = ("down_proj",), ("q_proj", "v_proj", "gate_proj")
TARGETS_SERVED = ("o_proj",)
RANK_A, RANK_B = 4, 8
DROPOUT_B, SEED_B = 0.25, 77
# (token count, num_computed, LoRA slot, window's job or None) per row of the flat batch
ROWS = [(5, 0, SERVED, None), (6, 0, JOB_A, "a"), (1, 7, -1, None), (4, 0, JOB_B, "b")]


# ------------------------------------------------------------------------------- use_triton
def test_use_triton_follows_the_environment_at_call_time(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("FLEXSERVE_KERNELS", raising=False)
    cpu = torch.device("cpu")
    assert use_triton(cpu) is False and use_triton("cpu") is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(cpu) is True and use_triton("cpu") is True
    monkeypatch.setenv("FLEXSERVE_KERNELS", "torch")
    assert use_triton(cpu) is False
    monkeypatch.setenv("FLEXSERVE_KERNELS", "AUTO")
    assert use_triton(cpu) is True
    monkeypatch.setenv("TRITON_INTERPRET", "off")
    assert use_triton(cpu) is False
    monkeypatch.setenv("TRITON_INTERPRET", "yes")
    assert use_triton(cpu) is True
    monkeypatch.delenv("TRITON_INTERPRET")
    assert use_triton(cpu) is False
    monkeypatch.setenv("FLEXSERVE_KERNELS", "triton")
    for _ in range(2):  # an invalid value is refused on every call, never cached
        with pytest.raises(ValueError, match="FLEXSERVE_KERNELS must be one of"):
            use_triton(cpu)
    monkeypatch.delenv("FLEXSERVE_KERNELS")
    assert use_triton(torch.device("meta")) is False
    # os.environ written directly (not through monkeypatch) is seen too
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    import os

    os.environ["TRITON_INTERPRET"] = "true"
    assert use_triton(cpu) is True


# ---------------------------------------------------------------------------- the model step
@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, tiny_config):
    return tiny_checkpoint(tiny_config("llama", num_hidden_layers=NUM_LAYERS), seed=3)


def build(path: str):
    """The tiny model with LoRA linears, random adapters in the three slots and a KV cache."""
    resolved = resolve_model(path, "auto")
    model = load_model(ModelConfig(model=path), resolved, torch.device("cpu"), torch.float32)
    hf_config = resolved.hf_config
    attach_lora_linears(model, MAX_LORAS, MAX_RANK)
    gen = torch.Generator().manual_seed(5)
    for slot, targets, rank in ((JOB_A, TARGETS_A, RANK_A), (JOB_B, TARGETS_B, RANK_B),
                                (SERVED, TARGETS_SERVED, RANK_B)):
        for layer in model.model.layers:
            for target in targets:
                module = getattr(getattr(layer, TARGET_MODULES[target]), target)
                a = torch.randn(rank, module.in_features, generator=gen) / module.in_features**0.5
                b = torch.randn(module.out_features, rank, generator=gen) * 0.3
                module.set_slot(slot, a, b, 2.0 / rank)
    num_blocks = sum(-(-(n + c) // BLOCK_SIZE) for n, c, _, _ in ROWS)
    shape = (2, num_blocks, BLOCK_SIZE, hf_config.num_key_value_heads, model.head_dim)
    model.bind_kv_caches([torch.zeros(shape) for _ in range(NUM_LAYERS)])
    return model, hf_config


def everything_plan(graph):
    """A plan keeping every tensor (bool masks as bitmasks) outside the KV cache."""
    from types import SimpleNamespace

    kv = frozenset(n for n, spec in graph.tensors.items() if spec.storage == "kv_cache")
    stored = frozenset(graph.tensors) - kv
    masks = {n: "bitmask" for n in stored if graph.tensors[n].dtype == "bool"}
    return SimpleNamespace(stored=stored, kv_cache=kv, rematerialized=frozenset(),
                           compressed=masks)


def make_stores(hf_config):
    graph_a = build_layer_graph(hf_config, dict.fromkeys(TARGETS_A, "lora"), rank=RANK_A)
    graph_b = build_layer_graph(hf_config, dict.fromkeys(TARGETS_B, "lora"), rank=RANK_B,
                                dropout=DROPOUT_B)
    plan_a = plan_pruning(graph_a, 4)
    # job B: every tensor in layer 1, the pruned plan elsewhere (plans differ by layer too)
    plans_b = [plan_pruning(graph_b, 4), everything_plan(graph_b), plan_pruning(graph_b, 4)]
    return {"a": ActivationStore(graph_a, plan_a, NUM_LAYERS, 16, torch.float32, "cpu"),
            "b": ActivationStore(graph_b, plans_b, NUM_LAYERS, 16, torch.float32, "cpu",
                                 lora_dropout=DROPOUT_B, dropout_seed=SEED_B)}


class RecordingCapture(FinetuneCapture):
    """The real capture, also keeping a copy of every whole flat-batch tensor it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[tuple[int, str], torch.Tensor] = {}

    def take(self, layer, name, tensor):
        self.seen[(layer, name)] = tensor.clone()
        super().take(layer, name, tensor)

    def take_lora_shrink(self, module, s):
        self.seen[(module.layer_idx, f"{module.target}_s")] = s.clone()
        super().take_lora_shrink(module, s)


def run_step(model, hf_config, stores, capture):
    """One flat-batch forward of ROWS under `capture`, as the model runner runs it (no_grad)."""
    gen = torch.Generator().manual_seed(11)
    row_lens = [n for n, _, _, _ in ROWS]
    block_tables, first, flat = [], 0, 0
    for n, computed, slot, job in ROWS:
        count = -(-(n + computed) // BLOCK_SIZE)
        block_tables.append(list(range(first, first + count)))
        first += count
        if job is not None:
            capture.add_window(stores[job], flat, computed, n, slot)
        flat += n
    metadata = AttentionMetadata.build(row_lens, [c for _, c, _, _ in ROWS], block_tables,
                                       BLOCK_SIZE, "cpu")
    lora_meta = LoRAKernelMeta.build(row_lens, [s for _, _, s, _ in ROWS], "cpu")
    ids = torch.randint(0, hf_config.vocab_size, (sum(row_lens),), generator=gen)
    with torch.no_grad(), set_forward_context(metadata, lora_meta, capture):
        return model(ids, metadata.positions)


def window_rows(index: int) -> slice:
    flat = sum(n for n, _, _, _ in ROWS[:index])
    return slice(flat, flat + ROWS[index][0])


def test_two_windows_with_different_plans_get_exactly_their_rows(tiny):
    model, hf_config = build(tiny)
    stores = make_stores(hf_config)
    capture = RecordingCapture()
    run_step(model, hf_config, stores, capture)
    num_checked = 0
    for index, (n, start, _slot, job) in enumerate(ROWS):
        if job is None:
            continue
        store, rows = stores[job], window_rows(index)
        for layer in range(NUM_LAYERS):
            kept = store.stored_names[layer]
            for name, spec in store.graph.tensors.items():
                if name not in kept:
                    if name not in store.bitmask_names[layer]:
                        with pytest.raises(KeyError):
                            store.read(layer, name, start, start + n)
                    continue
                got = store.read(layer, name, start, start + n)
                assert not got.is_inference()
                with pytest.raises(RuntimeError, match="captured"):  # nothing past the window
                    store.read(layer, name, start, start + n + 1)
                if name.endswith("_xd"):  # the dropped-out shrink input (job B's own mask)
                    target = name.removesuffix("_xd")
                    source = "h_attn" if target in ("q_proj", "v_proj") else "h_mlp"
                    keep = dropout_keep_mask(SEED_B, layer, target, start, n, spec.width,
                                             DROPOUT_B, "cpu")
                    want = apply_lora_dropout(capture.seen[(layer, source)][rows], keep, DROPOUT_B)
                elif name.endswith("_delta"):  # the expand's addition: out - base
                    target = name.removesuffix("_delta")
                    out = {"q_proj": "q_out", "v_proj": "v_out", "gate_proj": "gate_out"}[target]
                    want = (capture.seen[(layer, out)][rows]
                            - capture.seen[(layer, f"{target}_base")][rows])
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                    num_checked += 1
                    continue
                else:
                    want = capture.seen[(layer, name)][rows, :spec.width]
                assert torch.equal(got, want), (job, layer, name)
                num_checked += 1
            for name in store.bitmask_names[layer]:
                target = name.removesuffix("_mask")
                keep = dropout_keep_mask(SEED_B, layer, target, start, n,
                                         store.graph.tensors[name].width, DROPOUT_B, "cpu")
                assert torch.equal(store.dropout_mask(layer, target, start, start + n), keep)
    # every tensor kept in full was compared (job B's layer 1 keeps all but the KV cache's)
    assert num_checked == sum(len(s.stored_names[layer]) for s in stores.values()
                              for layer in range(NUM_LAYERS))
    assert len(stores["b"].stored_names[1]) > len(stores["b"].stored_names[0])
    expected_bytes = sum(
        16 * (math.ceil(s.graph.tensors[name].width / 8) if name in s.bitmask_names[layer]
              else s.graph.tensors[name].width * 4)
        for s in stores.values() for layer in range(NUM_LAYERS)
        for name in s.stored_names[layer] | s.bitmask_names[layer])
    assert sum(s.num_bytes for s in stores.values()) == expected_bytes
    store = stores["b"]
    layer_bytes = store.num_bytes - 16 * store.layer_bytes_per_token(1)
    store.free_layer(1)
    assert store.num_bytes == layer_bytes  # the cached count follows free_layer


def test_merged_projections_capture_what_separate_ones_do(tiny):
    model, hf_config = build(tiny)
    stores = make_stores(hf_config)
    separate = run_step(model, hf_config, stores, FinetuneCapture())
    model.merge_projections()  # q/k/v and gate/up as one GEMM each, as on the GPU path
    assert model.model.layers[0].self_attn.qkv.weight is not None
    merged_stores = make_stores(hf_config)
    merged = run_step(model, hf_config, merged_stores, FinetuneCapture())
    torch.testing.assert_close(merged, separate, rtol=1e-5, atol=1e-5)
    for job, store in stores.items():
        n = store.num_forward_tokens
        assert merged_stores[job].num_forward_tokens == n > 0
        for layer in range(NUM_LAYERS):
            for name in store.stored_names[layer]:
                torch.testing.assert_close(merged_stores[job].read(layer, name, 0, n),
                                           store.read(layer, name, 0, n), rtol=1e-5, atol=1e-5)

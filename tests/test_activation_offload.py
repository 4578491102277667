"""Offloaded layers of the activation store (`flexserve.worker.finetune.activation_offload`): what the
backward reads through the ring is exactly what the forward wrote, for any window split and
slot reuse, on the CPU (synchronous copies) and on CUDA (side-stream copies, with the forward's
tensors overwritten right after they were written); the device bytes the store reports.
The gradients of a job with offloaded layers against HF + PEFT: tests/test_layer_backward.py."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from flexserve.peft.activation_budget import NUM_SLOTS
from flexserve.peft.graph_pruning import plan_pruning
from flexserve.peft.layer_graph import build_layer_graph
from flexserve.worker.finetune.activation_store import ActivationStore, dropout_keep_mask

NUM_LAYERS, MAX_LEN = 6, 37


def _graph(tiny_config, dropout: float = 0.0):
    config = tiny_config("llama", num_hidden_layers=NUM_LAYERS)
    return build_layer_graph(config, {"down_proj": "lora", "q_proj": "lora"}, rank=4,
                             dropout=dropout)


def _roundtrip(graph, device, offload, seed: int, dropout: float = 0.0, clobber: bool = False,
               host_rows: int | None = None, plan=None):
    """Write random rows window by window (forward order), then read every layer back from the
    top down window by window (the backward's order); assert they are what was written. `plan`
    defaults to the graph's pruning plan."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    plan = plan or plan_pruning(graph, 4)
    store = ActivationStore(graph, plan, NUM_LAYERS, MAX_LEN, torch.float32, device,
                            lora_dropout=dropout, dropout_seed=seed, offload_layers=offload,
                            offload_host_rows=host_rows)
    names = sorted(store.stored_names[0])
    truth = {(layer, name): torch.randn(MAX_LEN, graph.tensors[name].width, generator=gen)
             for layer in range(NUM_LAYERS) for name in names}
    masks = {(layer, name): dropout_keep_mask(seed, layer, name[:-5], 0, MAX_LEN,
                                              graph.tensors[name].width, dropout, "cpu")
             for layer in range(NUM_LAYERS) for name in store.bitmask_names[layer]}
    start = 0
    while start < MAX_LEN:
        n = rng.randint(1, MAX_LEN - start)
        store.begin_window(start, n)
        for layer in range(NUM_LAYERS):
            for name in names:
                rows = truth[(layer, name)][start:start + n].to(device)
                store.write(layer, name, start, rows)
                if clobber:  # the forward's tensor changes right after: copies must not see it
                    rows.fill_(float("nan"))
            for name in store.bitmask_names[layer]:
                store.write_mask(layer, name, start, masks[(layer, name)][start:start + n].to(device))
        start += n
    assert store.num_bytes_stored == sum(store.layer_bytes_per_token(i)
                                         for i in range(NUM_LAYERS)) * MAX_LEN
    for layer in reversed(range(NUM_LAYERS)):
        end = MAX_LEN
        while end > 0:
            begin = end - rng.randint(1, end)
            store.prepare_layer(layer)
            for name in names:
                got = store.read(layer, name, begin, end).cpu()
                assert torch.equal(got, truth[(layer, name)][begin:end]), (layer, name, begin)
            for name in store.bitmask_names[layer]:
                got = store.dropout_mask(layer, name[:-5], begin, end).cpu()
                assert torch.equal(got, masks[(layer, name)][begin:end])
            end = begin
        store.free_layer(layer)
    return store


@pytest.mark.parametrize("offload", [(0, 1, 2, 3, 4, 5), (1, 3, 5), (2,), ()])
def test_offloaded_rows_come_back_exactly(tiny_config, offload):
    graph = _graph(tiny_config)
    plan = plan_pruning(graph, 4)
    per_layer = plan.bytes_per_token * MAX_LEN
    store = ActivationStore(graph, plan, NUM_LAYERS, MAX_LEN, torch.float32, "cpu",
                            offload_layers=offload)
    ring = NUM_SLOTS * per_layer if offload else 0
    assert store.num_bytes == (NUM_LAYERS - len(offload)) * per_layer + ring
    assert store.host_bytes == len(offload) * per_layer
    assert store.offload_layers == tuple(offload)
    for seed in range(3):
        store = _roundtrip(graph, "cpu", offload, seed)
        assert store.num_bytes == 0 and store.host_bytes == 0  # the ring went with the last layer


def test_host_buffers_sized_for_the_jobs_longest_sequence(tiny_config):
    graph = _graph(tiny_config)
    per_token = plan_pruning(graph, 4).bytes_per_token
    store = ActivationStore(graph, plan_pruning(graph, 4), NUM_LAYERS, MAX_LEN, torch.float32,
                            "cpu", offload_layers=(1, 3), offload_host_rows=3 * MAX_LEN)
    assert store.host_bytes == 2 * per_token * 3 * MAX_LEN
    _roundtrip(graph, "cpu", (1, 3, 4), seed=7, host_rows=3 * MAX_LEN)


def test_offloaded_dropout_bitmasks(tiny_config):
    # The pruning plan keeps no mask (dropout is folded into LoRA A); a plan that keeps the masks
    # as bitmasks round-trips them through offloaded layers too.
    graph = _graph(tiny_config, dropout=0.3)
    plan = plan_pruning(graph, 4)
    assert not plan.compressed
    masks = ("q_proj_mask", "down_proj_mask")
    plan = dataclasses.replace(
        plan, stored=plan.stored | set(masks), compressed=dict.fromkeys(masks, "bitmask"),
        bytes_per_token=plan.bytes_per_token + sum(math.ceil(graph.tensors[n].width / 8) for n in masks))
    store = _roundtrip(graph, "cpu", (1, 2, 3, 4), seed=4, dropout=0.3, plan=plan)
    assert store.bitmask_names[1] == set(masks)


def test_bad_offloads_are_refused(tiny_config):
    graph = _graph(tiny_config)
    plans = [plan_pruning(graph, 4, input_grad=False)] + [plan_pruning(graph, 4)] * 5
    assert plans[0].stored != plans[1].stored
    with pytest.raises(ValueError, match="same tensors"):
        ActivationStore(graph, plans, NUM_LAYERS, MAX_LEN, torch.float32, "cpu",
                        offload_layers=(0, 1))
    with pytest.raises(ValueError, match="not all in"):
        ActivationStore(graph, plans, NUM_LAYERS, MAX_LEN, torch.float32, "cpu",
                        offload_layers=(6,))
    store = ActivationStore(graph, plans, NUM_LAYERS, MAX_LEN, torch.float32, "cpu",
                            offload_layers=(1, 2))
    store.begin_window(0, 4)
    store.write(2, "x", 0, torch.ones(4, graph.tensors["x"].width))
    with pytest.raises(RuntimeError, match="before prepare"):
        store.read(2, "x", 0, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offload", [(0, 1, 2, 3, 4, 5), (1, 3, 5)])
def test_offload_on_cuda_side_stream(tiny_config, offload):
    graph = _graph(tiny_config)
    for seed in range(3):
        store = _roundtrip(graph, "cuda", offload, seed, clobber=True)
        assert store.num_bytes == 0
    _roundtrip(_graph(tiny_config, dropout=0.3), "cuda", offload, seed=5, dropout=0.3,
               clobber=True)

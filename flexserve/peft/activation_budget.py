"""One pruning plan per decoder layer, mixed to fit an activation-memory budget.

Graph pruning (`graph_pruning.plan_pruning`) gives one layer's plan. A job's activation store
holds one plan per layer (`ActivationStore` takes a list), and `plan_layers` picks them:

- Layer 0 needs no input gradient (nothing below it trains: PEFT leaves the embeddings frozen,
  and the layer-wise backward computes none there), so unless `layer0_input_grad` it gets
  whichever keeps fewer bytes of its plan without the input gradient and the other layers'
  plan (both are exact there). Llama-3.1-8B, LoRA on down_proj: the former, m alone (28 KiB
  per token instead of 80, and no recomputation); with chains at 0.6 the latter (x and x_mid,
  16 KiB, m recomputed through gate/up).
- The other layers get the base plan: algorithm 1 at `remat_threshold` (default 0.01), with
  chains if `chains`, i.e. exactly what `--remat-threshold` / `--remat-chains` ask for.
- With a budget (`budget_bytes` for `max_num_tokens` tokens, the longest sequence a store may
  hold), layers whose lean plan (chains at `remat_threshold`, or `BUDGET_REMAT_THRESHOLD` when
  none is configured) keeps fewer bytes switch to it one at a time, the largest saving first
  and among equal savings the lowest layer, until sum(bytes per token) x max_num_tokens <=
  budget. A budget that even all-lean layers exceed is a ValueError.

With `offload` (CUDA: `--finetune-activation-offload`), layers go to pinned host memory before
any goes lean (`flexserve.worker.finetune.activation_offload`): every other layer from layer 1 up
(`offload_candidates`), as few as fit. Their copies run on a side stream while the forward and
the backward go on, so they cost no recomputation; the device keeps a ring of `NUM_SLOTS` slots
of one layer each for them, which the budget counts. Every other layer, so that each copy has
two layers' compute to hide behind (a 4096-token Llama-3.1-8B layer keeps 0.34 GB, 6-7 ms over
PCIe 5 at 49-55 GB/s, measured on the H200; its forward about 3.5 ms:
the 4096-token forward step took 138 ms with its loss). Only when all of
them are offloaded and the budget still does not fit do the remaining layers go lean.

Which layers go lean does not change the peak (every layer's buffers are allocated when the
sequence starts), and every layer above 0 saves the same bytes for the same recomputation
(layer 0, which saves less for as much, goes last). The lowest ones go lean because the
backward frees the store from the top down: the large default layers go first, so the store
shrinks fastest while the backward runs. The mix changes no
gradient: each plan is exact on its own (`tests/test_activation_budget.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flexserve.peft.graph_pruning import DEFAULT_REMAT_THRESHOLD, PruningPlan, plan_pruning
from flexserve.peft.layer_graph import LayerGraph, build_layer_graph

# The lean plan's remat threshold when none is configured: with chains, Llama-3.1-8B with LoRA
# on down_proj then keeps x and x_mid only (16 KiB per token and layer instead of 80) and
# recomputes q, gate_out, up_out and m (62% of the layer's forward FLOPs) in the backward.
BUDGET_REMAT_THRESHOLD = 0.6
GIB = 1 << 30
# Device slots of an offload's ring (`flexserve.worker.finetune.activation_offload`): one layer in use
# while the next one is copied.
NUM_SLOTS = 2


@dataclass(frozen=True, slots=True)
class LayerPlans:
    """The pruning plan of every decoder layer of a job, and how the mix was chosen."""

    plans: tuple[PruningPlan, ...]  # plan of layer i, for `ActivationStore`
    lean_layers: tuple[int, ...]  # layers that got the lean plan (chains), ascending
    base_threshold: float  # remat threshold of the base plans (layers not in lean_layers)
    lean_threshold: float  # remat threshold of the lean plan (always with chains)
    budget_bytes: int | None  # activation budget; None: none (no layer goes lean)
    max_num_tokens: int | None  # tokens the budget is sized for (max_finetune_len)
    offload_layers: tuple[int, ...] = ()  # layers kept in host memory, ascending

    @property
    def bytes_per_token(self) -> int:
        """Activation-store bytes one token keeps over all layers (device and host)."""
        return sum(plan.bytes_per_token for plan in self.plans)

    @property
    def host_bytes_per_token(self) -> int:
        """Bytes per token of the offloaded layers (pinned host memory)."""
        return sum(self.plans[layer].bytes_per_token for layer in self.offload_layers)

    @property
    def device_bytes_per_token(self) -> int:
        """Device bytes per token: the layers kept there, and the offload ring's slots."""
        return _device_bytes(self.plans, self.offload_layers)

    @property
    def num_bytes(self) -> int | None:
        """Device bytes of a max_num_tokens-token sequence's store (None without
        max_num_tokens): what the budget bounds."""
        return (None if self.max_num_tokens is None
                else self.device_bytes_per_token * self.max_num_tokens)


def plan_layers(
    graph: LayerGraph,
    dtype_bytes: int,
    num_layers: int,
    remat_threshold: float | None = None,
    chains: bool = False,
    budget_bytes: int | None = None,
    max_num_tokens: int | None = None,
    layer0_input_grad: bool = False,
    offload: bool = False,
) -> LayerPlans:
    """Per-layer plans of `graph` (see the module docstring); ValueError for bad arguments or a
    budget that cannot hold max_num_tokens tokens even with every layer lean (and, with
    `offload`, every candidate layer in host memory)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    if max_num_tokens is not None and (isinstance(max_num_tokens, bool) or not isinstance(
            max_num_tokens, int) or max_num_tokens < 1):
        raise ValueError(f"max_num_tokens must be a positive integer, got {max_num_tokens!r}")
    if budget_bytes is not None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise ValueError(f"the activation budget must be a positive number of bytes, got "
                             f"{budget_bytes!r}")
        if max_num_tokens is None:
            raise ValueError("an activation budget needs max_num_tokens (max_finetune_len): the "
                             "tokens one sequence's store may hold")
    base_threshold = DEFAULT_REMAT_THRESHOLD if remat_threshold is None else remat_threshold
    lean_threshold = BUDGET_REMAT_THRESHOLD if remat_threshold is None else remat_threshold
    cache: dict[tuple[bool, bool], PruningPlan] = {}

    def plan(input_grad: bool, lean: bool) -> PruningPlan:
        if (input_grad, lean) not in cache:
            cache[(input_grad, lean)] = plan_pruning(
                graph, dtype_bytes, lean_threshold if lean else base_threshold,
                input_grad=input_grad, chains=lean or chains)
        return cache[(input_grad, lean)]

    def layer_plan(layer: int, lean: bool) -> PruningPlan:
        if layer > 0 or layer0_input_grad:
            return plan(True, lean)
        # Both are exact in layer 0; min() keeps the first (no input gradient) on a tie.
        return min(plan(False, lean), plan(True, lean), key=lambda p: p.bytes_per_token)

    plans = [layer_plan(layer, False) for layer in range(num_layers)]
    lean_layers: list[int] = []
    offloaded: tuple[int, ...] = ()
    if budget_bytes is not None:
        def fits() -> bool:
            return _device_bytes(plans, offloaded) * max_num_tokens <= budget_bytes

        if offload:  # the fewest candidates that fit, else all of them (and lean layers next)
            candidates = offload_candidates(plans)
            for count in range(len(candidates) + 1):
                offloaded = candidates[:count]
                if fits():
                    break
        savings = {layer: plans[layer].bytes_per_token - layer_plan(layer, True).bytes_per_token
                   for layer in range(num_layers) if layer not in offloaded}
        candidates = sorted((layer for layer, saving in savings.items() if saving > 0),
                            key=lambda layer: (-savings[layer], layer))
        for layer in candidates:
            if fits():
                break
            plans[layer] = layer_plan(layer, True)
            lean_layers.append(layer)
        need = _device_bytes(plans, offloaded) * max_num_tokens
        if need > budget_bytes:
            raise ValueError(
                f"the activation budget of {budget_bytes / GIB:.3g} GiB cannot hold a "
                f"{max_num_tokens}-token sequence: even with remat chains at threshold "
                f"{lean_threshold:g} in every layer"
                f"{f' and {len(offloaded)} layers in host memory' if offloaded else ''} it needs "
                f"{need / GIB:.3g} GiB ({need // max_num_tokens:,} B per token over "
                f"{num_layers} layers); raise --finetune-activation-budget, lower "
                "--max-finetune-len, or train fewer or lower-rank targets")
    return LayerPlans(plans=tuple(plans), lean_layers=tuple(sorted(lean_layers)),
                      base_threshold=float(base_threshold), lean_threshold=float(lean_threshold),
                      budget_bytes=budget_bytes, max_num_tokens=max_num_tokens,
                      offload_layers=offloaded)


def offload_candidates(plans: list[PruningPlan]) -> tuple[int, ...]:
    """The layers an offload may take, in the order it takes them: every other layer from
    layer 1 up, among those with layer 1's plan (the ring's slots hold one layout)."""
    if len(plans) < 2:
        return ()
    return tuple(layer for layer in range(1, len(plans), 2)
                 if plans[layer] == plans[1] and plans[1].bytes_per_token > 0)


def _device_bytes(plans: Any, offloaded: tuple[int, ...]) -> int:
    """Device bytes per token of `plans` with `offloaded` in host memory (and the ring)."""
    resident = sum(plan.bytes_per_token for layer, plan in enumerate(plans)
                   if layer not in offloaded)
    ring = NUM_SLOTS * max((plans[layer].bytes_per_token for layer in offloaded), default=0)
    return resident + ring


def budget_bytes_from_gib(budget_gib: float | None) -> int | None:
    """--finetune-activation-budget (GiB) in bytes; None stays None."""
    return None if budget_gib is None else int(budget_gib * GIB)


def plan_job_layers(
    hf_config: Any, target_modules: Any, rank: int, dropout: float, dtype_bytes: int,
    remat_threshold: float | None = None, chains: bool = False,
    budget_gib: float | None = None, max_num_tokens: int | None = None,
) -> LayerPlans:
    """`plan_layers` for a LoRA job on `target_modules` of `hf_config`'s decoder layers: what the
    worker's job keeps, and a check an API route can run before accepting a job (ValueError
    when the budget cannot hold it)."""
    graph = build_layer_graph(hf_config, dict.fromkeys(target_modules, "lora"), rank=rank,
                              dropout=dropout)
    return plan_layers(graph, dtype_bytes, hf_config.num_hidden_layers, remat_threshold, chains,
                       budget_bytes_from_gib(budget_gib), max_num_tokens)

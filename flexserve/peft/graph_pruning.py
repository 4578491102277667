"""Static graph pruning (FlexLLM section 5.2, algorithm 1) over one decoder layer's op graph.

Given a `LayerGraph` with bypass networks attached, the pass decides which forward tensors the
layer-wise backward needs and how each is kept:

- Step 1 (pruning): build the backward graph by reverse-mode autodiff (one backward op per forward
  op, `backward_rule` says which forward tensors it reads for each gradient it makes), drop the
  gradients of frozen backbone weights, then drop, until nothing changes, every activation
  gradient no backward op reads. A is the set of forward tensors some remaining backward op reads.
- Step 2 (rematerialization): walking A in forward order, t moves to R when its producer's inputs
  are all in A and recomputing t costs less than the threshold (see `plan_pruning`). As an
  extension beyond the paper, an input outside A may itself be recomputed on the way (a chain
  through tensors the backward never reads, e.g. gate_out from x_mid through h_mlp), its cost
  counted. Off by default (`chains=False`: algorithm 1 as the paper states it).
- LoRA dropout: the engine's dropout mask is a hash of (the job's seed, layer, target, token
  position) (`activation_store.dropout_keep_mask`; the fused LoRA kernels regenerate it in
  registers), not random state, so the pass plans each adapter's dropout and LoRA A as one op,
  LoRAFusion's fused dropout + shrink (`fold_lora_dropout`): LoRA A's backward reads the
  dropout's input, and neither the mask nor the dropout's output is kept. With dropout the plan is
  the plan without it. (Before, the masks were random state to this pass: it stored each as a
  bitmask, and each dropout output whose input was not in A; with dropout on Llama-3.1-8B's seven
  projections that was 164,608 bytes per token and layer against 90,112 now.)
- Compression: a bool tensor is read only as a mask, so one the plan stores is kept as a bitmask
  (1 bit per element). The LoRA graphs have none left once their dropout is folded.

The gradient of the layer input x is needed whenever a lower layer trains (every layer but the
first for PEFT on decoder layers: the embeddings are frozen), so it is a fixed sink of the
backward graph; `input_grad=False` (layer 0) removes it and pruning then propagates through the
layer. K and V (`storage="kv_cache"`) are needed but live in the paged KV cache (FlexLLM keeps them
there until the layer's backward is done), so they cost no activation bytes.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import torch

from flexserve.peft.layer_graph import IA3_INPUT_SCALED, LayerGraph, Op

LAYER_INPUT, LAYER_OUTPUT = "x", "x_next"
# A tensor is rematerialized when recomputing it costs under this fraction of the layer's forward
# FLOPs per token. Llama-3.1-8B: 1% is 4.4 MFLOP; RMSNorm 16 K, SiLU-mul 72 K, a rank-16 LoRA
# shrink 131-459 K (rank 64: 1.8 M), the smallest frozen GEMM (k_proj) 8.4 M = 1.9%.
DEFAULT_REMAT_THRESHOLD = 0.01
_FROZEN_WEIGHT_KINDS = ("linear", "rmsnorm")  # ops with a backbone weight (its gradient is pruned)


def backward_rule(op: Op, wrt: str) -> frozenset[str]:
    """UPDATEINPUT for one gradient: the forward tensors `op`'s backward reads to produce the
    gradient w.r.t. `wrt` (an input tensor, a trainable parameter, or the frozen backbone weight
    f"{op.name}.weight"). Every gradient also reads the gradients of op's outputs."""
    kind, inputs = op.kind, frozenset(op.inputs)
    if kind == "linear":  # Y = X W^T: dX = dY W reads no activation; dW = dY^T X reads X
        return inputs if wrt == f"{op.name}.weight" else frozenset()
    if kind == "rmsnorm":  # y = g * x * rstd(x): dx (and dg) read x; rstd is recomputed from x
        return inputs
    if kind in ("lora_a", "lora_b", "ia3"):  # s = X A^T, delta = c s B^T, y = l * t:
        return inputs if wrt in op.trainable else frozenset()  # dA/dB/dl read the input, dX not
    if kind in ("add", "rope"):  # rope's cos/sin come from the window's positions
        return frozenset()
    if kind == "attention":  # the backward recomputes the forward (SDPA/flash): no out, no lse
        return inputs
    if kind == "silu_mul":  # m = silu(g) * u: dg reads g and u, du reads g
        gate, up = op.inputs
        return inputs if wrt == gate else frozenset({gate})
    raise ValueError(f"no backward rule for op kind {kind!r} ({op.name})")


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """How one forward tensor the backward needs is kept."""

    name: str  # layer-graph tensor name
    width: int  # elements per token
    status: str  # "stored" | "kv_cache" | "rematerialized" (also a chain's intermediate)
    compression: str | None  # "bitmask" (1 bit per element) or None
    bytes_per_token: int  # activation-store bytes per token (0 unless stored)
    needed_by: tuple[str, ...]  # forward ops whose backward reads it
    recompute_from: tuple[str, ...]  # rematerialized: the tensors it is recomputed from
    recompute_flops: int  # rematerialized: FLOPs per token to recompute it (chain included)


@dataclass(frozen=True, slots=True)
class PruningPlan:
    """What one decoder layer keeps for its backward (per token, token-indexed)."""

    stored: frozenset[str]  # A after rematerialization, KV-cache tensors excluded
    kv_cache: frozenset[str]  # needed and read from the paged KV cache (k, v_out)
    rematerialized: frozenset[str]  # R: recomputed in the backward from stored/kv/R tensors
    compressed: dict[str, str]  # stored tensor -> "bitmask"
    bytes_per_token: int  # activation bytes per token of this layer
    tensors: tuple[TensorPlan, ...]  # every needed tensor and chain intermediate, forward order
    backward: dict[str, tuple[str, ...]]  # forward op -> what its backward still computes:
    #                                       input tensors (their grads) and trainable parameters
    unpruned_bytes_per_token: int  # bytes of A if backbone weight gradients were kept (no remat)
    layer_flops_per_token: int  # forward FLOPs per token of the layer, attention excluded
    remat_threshold: float  # fraction of layer_flops_per_token a recomputation may cost
    input_grad: bool  # whether the gradient of the layer input x is produced
    chains: bool = False  # whether rematerialization could go through tensors outside A

    @property
    def remat_order(self) -> tuple[str, ...]:
        """R in forward order: recomputing in this order only reads available tensors."""
        return tuple(t.name for t in self.tensors if t.status == "rematerialized")


class _BackwardOp:
    """A backward op of the reverse graph with its current outputs O and inputs I."""

    def __init__(self, op: Op, upstream: frozenset[str]) -> None:
        self.op = op
        self.upstream = upstream  # gradients of op's outputs (read by every gradient it makes)
        self.outputs: dict[str, str] = {_grad(t, op.name): t for t in op.inputs}
        self.outputs.update({f"grad({p})": p for p in op.trainable})
        if op.kind in _FROZEN_WEIGHT_KINDS:
            self.outputs[f"grad({op.name}.weight)"] = f"{op.name}.weight"
        self.inputs = self.update_input()

    def update_input(self) -> frozenset[str]:
        needed: set[str] = set()
        for wrt in self.outputs.values():
            needed |= backward_rule(self.op, wrt) | self.upstream
        return frozenset(needed)


def _grad(tensor: str, consumer: str) -> str:
    """The partial gradient of `tensor` that the backward of its reader `consumer` produces."""
    return f"grad({tensor})@{consumer}"


def _prune(graph: LayerGraph, input_grad: bool, prune_base: bool) -> dict[str, _BackwardOp]:
    """Step 1 of algorithm 1: the backward graph after pruning, by forward op name."""
    readers = {t: [op.name for op in graph.ops if t in op.inputs] for t in graph.tensors}
    bwd: dict[str, _BackwardOp] = {}
    for op in graph.ops:
        upstream = {_grad(t, r) for t in op.outputs if graph.tensors[t].dtype != "bool"
                    for r in readers[t]}
        if LAYER_OUTPUT in op.outputs:
            upstream.add(f"grad({LAYER_OUTPUT})")  # from the layer above
        bwd[op.name] = _BackwardOp(op, frozenset(upstream))
    # The layer below reads grad(x) unless nothing below trains.
    sink = frozenset(_grad(LAYER_INPUT, r) for r in readers[LAYER_INPUT]) if input_grad else set()
    producer = {g: name for name, b in bwd.items() for g in b.outputs}
    queue: deque[str] = deque()  # Q: updated operators

    def remove(b: _BackwardOp, g: str) -> None:
        del b.outputs[g]
        before, b.inputs = b.inputs, b.update_input()
        queue.append(b.op.name)
        # The listing re-checks O(n) of the updated n; the gradients n stopped reading are the
        # ones that may have lost their last reader, so their producers are re-checked too:
        # that is what carries the removal through the graph (layer 0, input_grad=False).
        queue.extend(producer[t] for t in sorted(before - b.inputs) if t in producer)

    for name in reversed(bwd):  # lines 5-10: drop backbone weight gradients
        b = bwd[name]
        for g, wrt in list(b.outputs.items()):
            if prune_base and wrt == f"{b.op.name}.weight":
                remove(b, g)
    while queue:  # lines 11-17: drop activation gradients nobody reads
        b = bwd[queue.popleft()]
        for g, wrt in list(b.outputs.items()):
            if wrt in graph.tensors and g not in sink and not any(
                    g in u.inputs for u in bwd.values()):
                remove(b, g)
    return bwd


def fold_lora_dropout(graph: LayerGraph) -> LayerGraph:
    """`graph` with each LoRA dropout op folded into the LoRA A op that reads its output: LoRA A
    reads the dropout's input, and the dropout op, its output and its mask are gone (the mask is
    regenerated from its seed wherever it is applied). The graph itself when it has no dropout."""
    dropouts = {op.outputs[0]: op for op in graph.ops if op.kind == "dropout"}
    if not dropouts:
        return graph
    ops = []
    for op in graph.ops:
        if op.kind == "dropout":
            continue
        if op.kind == "lora_a" and op.inputs[0] in dropouts:
            op = replace(op, inputs=dropouts[op.inputs[0]].inputs)
        ops.append(op)
    gone = {t for op in dropouts.values() for t in op.outputs}
    tensors = {name: spec for name, spec in graph.tensors.items() if name not in gone}
    return replace(graph, ops=tuple(ops), tensors=tensors)


def _needed(graph: LayerGraph, bwd: dict[str, _BackwardOp]) -> dict[str, list[str]]:
    """Lines 18-22: A, in forward order (x first), each with the ops whose backward reads it."""
    order = [LAYER_INPUT] + [t for op in graph.ops for t in op.outputs]
    needed = {}
    for t in order:
        readers = [name for name, b in bwd.items() if t in b.inputs]
        if readers:
            needed[t] = readers
    return needed


def _recompute_cost(
    graph: LayerGraph, t: str, needed: dict[str, list[str]],
    remat: dict[str, tuple[tuple[str, ...], int]], chain: dict[str, tuple[tuple[str, ...], int]],
    chains: bool,
) -> float | None:
    """FLOPs per token to recompute t from what is kept; None when it cannot be (algorithm 1: an
    input outside A; with `chains`, one that cannot be recomputed itself). Records t and every
    intermediate outside A it goes through in `chain` (sources, cost)."""
    op = graph.producer(t)
    if op is None:
        return None
    sources = op.inputs
    cost = math.inf if op.kind == "attention" else op.flops_per_token
    for s in sources:
        if s in remat or s in chain:
            cost += (remat.get(s) or chain[s])[1]
        elif s not in needed:  # not kept: recomputed on the way, if chains may
            sub = _recompute_cost(graph, s, needed, remat, chain, chains) if chains else None
            if sub is None:
                return None
            cost += sub
    chain[t] = (sources, cost)
    return cost


def _row_bytes(graph: LayerGraph, name: str, dtype_bytes: int) -> int:
    spec = graph.tensors[name]
    if spec.dtype == "bool":  # a bitmask row is padded to whole bytes so windows slice rows
        return math.ceil(spec.width / 8)
    return spec.width * (4 if spec.dtype == "fp32" else dtype_bytes)


def plan_pruning(
    graph: LayerGraph,
    dtype_bytes: int,
    remat_threshold: float = DEFAULT_REMAT_THRESHOLD,
    input_grad: bool = True,
    chains: bool = False,
) -> PruningPlan:
    """Run algorithm 1 on one layer graph (its LoRA dropout folded, `fold_lora_dropout`);
    `dtype_bytes` is the activation dtype's size.

    Step 2 visits A in forward order. t moves to R when every input its producer reads is in A
    as step 1 left it, and COST(t) < remat_threshold x the layer's forward FLOPs per token
    (attention excluded); remat_threshold 0 rematerializes nothing. An input that already moved
    to R is no longer stored, so it is recomputed first and COST(t) pays for it: COST(t) = the
    producer's `flops_per_token` + COST of each input in R (a chain is paid in full). Forward
    order decides every input before t, so the result is deterministic, and R is recomputable,
    in forward order, from stored and KV-cache tensors. Attention costs infinity (its FLOPs grow
    with the context and it needs the whole KV prefix).

    `chains` (beyond algorithm 1): an input outside A counts as recomputable when its own
    producer's inputs are (recursively), at its cost; such chain intermediates join R (needed_by
    empty) when the tensor they serve does. Llama-3.1-8B, LoRA on down_proj, threshold 0.6: only
    x and x_mid are stored (16 KiB per token and layer instead of 80): q is recomputed from x
    through h_attn and q_proj (7.7% of the layer's forward FLOPs), gate_out, up_out and m from
    x_mid through h_mlp (54%), so memory trades for backward time (`flexserve finetune-plan
    --remat-chains --remat-threshold 0.6` shows the plan).
    """
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be a positive integer, got {dtype_bytes!r}")
    if not isinstance(remat_threshold, (int, float)) or not 0 <= remat_threshold < math.inf:
        raise ValueError(f"remat_threshold must be a finite number >= 0, got {remat_threshold!r}")
    graph = fold_lora_dropout(graph)
    bwd = _prune(graph, input_grad, prune_base=True)
    needed = _needed(graph, bwd)
    layer_flops = sum(op.flops_per_token for op in graph.ops if op.kind != "attention")
    budget = remat_threshold * layer_flops
    remat: dict[str, tuple[tuple[str, ...], int]] = {}  # t -> (recomputed from, cost)
    for t in needed:
        if graph.tensors[t].storage == "kv_cache":
            continue
        chain: dict[str, tuple[tuple[str, ...], int]] = {}
        cost = _recompute_cost(graph, t, needed, remat, chain, chains)
        if cost is not None and cost < budget:
            remat.update(chain)
    compressed = {t: "bitmask" for t in needed
                  if t not in remat and graph.tensors[t].dtype == "bool"}
    tensors = []
    order = {name: i for i, name in enumerate(graph.tensors)}
    listed = {**needed, **{t: [] for t in remat if t not in needed}}
    for t in sorted(listed, key=order.__getitem__):
        readers = listed[t]
        spec = graph.tensors[t]
        status = ("kv_cache" if spec.storage == "kv_cache" else
                  "rematerialized" if t in remat else "stored")
        sources, cost = remat.get(t, ((), 0))
        tensors.append(TensorPlan(
            name=t, width=spec.width, status=status, compression=compressed.get(t),
            bytes_per_token=_row_bytes(graph, t, dtype_bytes) if status == "stored" else 0,
            needed_by=tuple(readers), recompute_from=sources, recompute_flops=cost))
    unpruned = _needed(graph, _prune(graph, input_grad, prune_base=False))
    return PruningPlan(
        stored=frozenset(t.name for t in tensors if t.status == "stored"),
        kv_cache=frozenset(t.name for t in tensors if t.status == "kv_cache"),
        rematerialized=frozenset(remat),
        compressed=compressed,
        bytes_per_token=sum(t.bytes_per_token for t in tensors),
        tensors=tuple(tensors),
        backward={name: tuple(b.outputs.values()) for name, b in bwd.items()},
        unpruned_bytes_per_token=sum(_row_bytes(graph, t, dtype_bytes) for t in unpruned
                                     if graph.tensors[t].storage != "kv_cache"),
        layer_flops_per_token=layer_flops,
        remat_threshold=float(remat_threshold),
        input_grad=input_grad,
        chains=chains,
    )


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _FusedDropout(torch.nn.Module):
    """nn.Dropout as CUDA runs it (`native_dropout`, which saves a 1-byte bool mask) also on the
    CPU, where `F.dropout` multiplies by a saved mask in the input's float dtype."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, self.p, self.training)[0]


class AutogradProbe:
    """One HF transformers decoder layer of `hf_config` with `peft` adapters, to measure what
    ordinary PyTorch autograd keeps for it.

    The layer has the real widths, random weights, SDPA attention and a frozen backbone, with
    LoRA (`rank`, `dropout`) or (IA)3 attached as in `bypass`, all in `dtype` (adapter weights
    too: PEFT's default fp32 adapters would add fp32 copies of their inputs). LoRA dropout runs
    as on CUDA (a bool mask is saved), not as torch's CPU path (a mask in the float dtype).
    Building it for Llama-3.1-8B takes ~2 s and ~0.5 GB of CPU memory in bfloat16.
    """

    def __init__(self, hf_config: Any, bypass: dict[str, str], dtype: torch.dtype | str,
                 rank: int = 16, dropout: float = 0.0) -> None:
        from peft import IA3Config, LoraConfig, inject_adapter_in_model
        from transformers import AutoModelForCausalLM

        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPES)}")
            dtype = _DTYPES[dtype]
        unknown = sorted(set(bypass.values()) - {"lora", "ia3"})
        if unknown:
            raise ValueError(f"unknown bypass kind(s) {unknown}; known: lora, ia3")
        config = copy.deepcopy(hf_config)
        config.num_hidden_layers, config.vocab_size = 1, 8  # one layer, no real embedding table
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:1]
        config._attn_implementation = "sdpa"
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        layer = model.model.layers[0]
        layer.requires_grad_(False)
        lora = [t for t, kind in bypass.items() if kind == "lora"]
        ia3 = [t for t, kind in bypass.items() if kind == "ia3"]
        if lora:
            inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, lora_dropout=dropout,
                                               target_modules=lora), layer, adapter_name="lora")
        if ia3:
            with warnings.catch_warnings():  # a second adapter beside LoRA is what we want here
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                inject_adapter_in_model(IA3Config(target_modules=ia3, feedforward_modules=[
                    t for t in ia3 if t in IA3_INPUT_SCALED]), layer, adapter_name="ia3")
        for module in layer.modules():  # torch's CPU dropout keeps a float mask, CUDA's a bool
            for key, drop in getattr(module, "lora_dropout", {}).items():
                if isinstance(drop, torch.nn.Dropout):
                    module.lora_dropout[key] = _FusedDropout(drop.p)
        self.layer = layer.to(dtype).train()
        self.rotary = model.model.rotary_emb
        self.hidden_size, self.dtype = config.hidden_size, dtype
        self._adapter = {n for n, p in layer.named_parameters() if p.requires_grad}

    def bytes_per_token(self, input_grad: bool = True, frozen_backbone: bool = True,
                        num_tokens: int = 4) -> int:
        """Bytes of the distinct storages autograd saves (parameters excluded), per token.

        Forwards of `num_tokens` and 2 x `num_tokens` tokens run under `saved_tensors_hooks`; the
        difference divided by `num_tokens` is the per-token figure, so whatever does not grow
        with the tokens cancels. The rotary cos/sin tables are not counted: all layers share
        them. `input_grad` makes the layer input require grad (False: layer 0);
        `frozen_backbone=False` trains the backbone too (full fine-tuning: no pruning at all).
        """
        if type(num_tokens) is not int or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
        for name, param in self.layer.named_parameters():
            param.requires_grad_(name in self._adapter or not frozen_backbone)
        params = {p.untyped_storage().data_ptr() for p in self.layer.parameters()}

        def saved_bytes(tokens: int) -> int:
            x = torch.randn(1, tokens, self.hidden_size, dtype=self.dtype,
                            requires_grad=input_grad)
            with torch.no_grad():
                cos, sin = self.rotary(x, torch.arange(tokens)[None])
            skip = params | {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
            saved: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in skip:
                    saved[storage.data_ptr()] = storage.nbytes()
                return t

            with torch.random.fork_rng(devices=[]), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                self.layer(x, position_embeddings=(cos, sin))
            return sum(saved.values())

        return (saved_bytes(2 * num_tokens) - saved_bytes(num_tokens)) // num_tokens


def full_autograd_bytes_per_token(
    hf_config: Any,
    bypass: dict[str, str],
    dtype: torch.dtype | str,
    rank: int = 16,
    dropout: float = 0.0,
    input_grad: bool = True,
    frozen_backbone: bool = True,
) -> int:
    """Measured: the bytes per token that ordinary PyTorch autograd keeps for one decoder layer
    of `hf_config` with `peft` LoRA / (IA)3 on `bypass` (see `AutogradProbe`)."""
    probe = AutogradProbe(hf_config, bypass, dtype, rank=rank, dropout=dropout)
    return probe.bytes_per_token(input_grad=input_grad, frozen_backbone=frozen_backbone)

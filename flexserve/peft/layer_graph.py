"""One decoder layer as an op graph with named tensors: the contract between graph pruning
(`flexserve.peft.graph_pruning`, FlexLLM algorithm 1), the activation store the worker fills during
fine-tuning forward windows, and the layer-wise backward that reads it (FlexLLM algorithm 2).

Tensor names are per layer and token-indexed (every tensor here has one row per token):

    x                                   layer input (the residual stream)
    h_attn   = input_layernorm(x)       rmsnorm, frozen weight
    {p}_out  = p(h_attn), p in q/k/v    backbone linear, plus its bypass when attached
    q, k     = rope(q_out), rope(k_out)
    attn     = attention(q, k, v_out)   causal over the sequence's keys in the paged KV cache
    o_out    = o_proj(attn)
    x_mid    = x + o_out
    h_mlp    = post_attention_layernorm(x_mid)
    gate_out, up_out = gate_proj(h_mlp), up_proj(h_mlp)
    m        = silu(gate_out) * up_out
    down_out = down_proj(m)
    x_next   = x_mid + down_out         the next layer's x

A bypass on projection p adds ops and tensors named after p (q_proj, ..., down_proj):

    LoRA:  p.dropout  {in} -> {p}_xd, {p}_mask   only when dropout > 0 (training); the mask
                                          (dtype "bool") is its state, which backward reads
           p.linear   {in} -> {p}_base    frozen backbone GEMM
           p.lora_a   {p}_xd|{in} -> {p}_s   [T, r] shrink, trainable A
           p.lora_b   {p}_s -> {p}_delta  expand with scaling, trainable B
           p.add      {p}_base, {p}_delta -> {p}_out
    (IA)3 on q/k/v/o/gate/up (output scaling): p.linear {in} -> {p}_base; p.ia3 {p}_base -> {p}_out
    (IA)3 on down_proj (a feed-forward module, PEFT scales its input):
           p.ia3 m -> m_scaled; p.linear m_scaled -> down_out

`k` and `v_out` are what the paged KV cache holds for the sequence anyway (algorithm 2 keeps K/V
there until the layer's backward is done), so they have `storage="kv_cache"`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flexserve.peft.bypass import TARGET_MODULES

BYPASS_KINDS = ("lora", "ia3")
# PEFT's IA3 scales the input of feed-forward modules and the output of the others.
IA3_INPUT_SCALED = ("down_proj",)

_PROJECTION_IO = {  # target -> (input tensor, output tensor) in the layer graph
    "q_proj": ("h_attn", "q_out"),
    "k_proj": ("h_attn", "k_out"),
    "v_proj": ("h_attn", "v_out"),
    "o_proj": ("attn", "o_out"),
    "gate_proj": ("h_mlp", "gate_out"),
    "up_proj": ("h_mlp", "up_out"),
    "down_proj": ("m", "down_out"),
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A per-token tensor of the layer graph."""

    name: str  # unique within the layer
    width: int  # elements per token
    dtype: str  # "act": the model's dtype; "fp32"; "bool": one bit per element when compressed
    storage: str = "activation"  # "activation": the store may keep it; "kv_cache": lives there


@dataclass(frozen=True, slots=True)
class Op:
    """One forward operator of the layer graph."""

    name: str  # e.g. "input_layernorm", "q_proj.linear", "q_proj.lora_a", "attention"
    kind: str  # rmsnorm | linear | dropout | lora_a | lora_b | ia3 | add | rope | attention | silu_mul
    inputs: tuple[str, ...]  # tensor names read
    outputs: tuple[str, ...]  # tensor names written
    trainable: tuple[str, ...] = ()  # trainable parameters (e.g. "q_proj.lora_A"); () for frozen ops
    flops_per_token: int = 0  # forward multiply-adds x 2 per token (attention: per token of context)


@dataclass(frozen=True, slots=True)
class LayerGraph:
    """The ops of one decoder layer in forward order and the specs of their tensors."""

    ops: tuple[Op, ...]
    tensors: dict[str, TensorSpec]
    bypass: dict[str, str]  # target -> "lora" | "ia3" for the attached bypass networks

    def producer(self, tensor: str) -> Op | None:
        """The op that writes `tensor`; None for the layer input x."""
        for op in self.ops:
            if tensor in op.outputs:
                return op
        return None


def build_layer_graph(
    hf_config: Any, bypass: dict[str, str], rank: int = 16, dropout: float = 0.0
) -> LayerGraph:
    """The graph of one decoder layer of a Llama-family `hf_config` with a bypass of kind
    bypass[target] ("lora" or "ia3") on each listed target linear. ValueError for unknown
    targets or kinds."""
    for target, kind in bypass.items():
        if target not in TARGET_MODULES:
            raise ValueError(f"unknown target module {target!r}; known: {', '.join(TARGET_MODULES)}")
        if kind not in BYPASS_KINDS:
            raise ValueError(f"unknown bypass kind {kind!r} for {target}; known: {BYPASS_KINDS}")
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    q_dim, kv_dim = heads * head_dim, hf_config.num_key_value_heads * head_dim
    inter = hf_config.intermediate_size
    widths = {"x": hidden, "h_attn": hidden, "q_out": q_dim, "k_out": kv_dim, "v_out": kv_dim,
              "q": q_dim, "k": kv_dim, "attn": q_dim, "o_out": hidden, "x_mid": hidden,
              "h_mlp": hidden, "gate_out": inter, "up_out": inter, "m": inter, "m_scaled": inter,
              "down_out": hidden, "x_next": hidden}
    tensors: dict[str, TensorSpec] = {}
    ops: list[Op] = []

    def tensor(name: str, width: int, dtype: str = "act", storage: str = "activation") -> None:
        tensors[name] = TensorSpec(name, width, dtype, storage)

    def op(name: str, kind: str, inputs: tuple[str, ...], outputs: tuple[str, ...],
           trainable: tuple[str, ...] = (), flops: int = 0) -> None:
        for out in outputs:
            if out not in tensors:
                tensor(out, widths[out])
        ops.append(Op(name, kind, inputs, outputs, trainable, flops))

    def projection(target: str) -> None:
        src, dst = _PROJECTION_IO[target]
        n_in, n_out = widths[src], widths[dst]
        kind = bypass.get(target)
        if kind is None:
            op(f"{target}.linear", "linear", (src,), (dst,), flops=2 * n_in * n_out)
        elif kind == "lora":
            x_in = src
            if dropout > 0:
                x_in = f"{target}_xd"
                tensor(x_in, n_in)
                tensor(f"{target}_mask", n_in, dtype="bool")
                op(f"{target}.dropout", "dropout", (src,), (x_in, f"{target}_mask"))
            tensor(f"{target}_base", n_out)
            tensor(f"{target}_s", rank)
            tensor(f"{target}_delta", n_out)
            op(f"{target}.linear", "linear", (src,), (f"{target}_base",), flops=2 * n_in * n_out)
            op(f"{target}.lora_a", "lora_a", (x_in,), (f"{target}_s",),
               (f"{target}.lora_A",), flops=2 * n_in * rank)
            op(f"{target}.lora_b", "lora_b", (f"{target}_s",), (f"{target}_delta",),
               (f"{target}.lora_B",), flops=2 * rank * n_out)
            op(f"{target}.add", "add", (f"{target}_base", f"{target}_delta"), (dst,), flops=n_out)
        elif target in IA3_INPUT_SCALED:
            op(f"{target}.ia3", "ia3", (src,), ("m_scaled",), (f"{target}.ia3_l",), flops=n_in)
            op(f"{target}.linear", "linear", ("m_scaled",), (dst,), flops=2 * n_in * n_out)
        else:
            tensor(f"{target}_base", n_out)
            op(f"{target}.linear", "linear", (src,), (f"{target}_base",), flops=2 * n_in * n_out)
            op(f"{target}.ia3", "ia3", (f"{target}_base",), (dst,), (f"{target}.ia3_l",),
               flops=n_out)

    tensor("x", hidden)
    op("input_layernorm", "rmsnorm", ("x",), ("h_attn",), flops=4 * hidden)
    for target in ("q_proj", "k_proj", "v_proj"):
        projection(target)
    tensor("q", q_dim)
    tensor("k", kv_dim, storage="kv_cache")
    tensors["v_out"] = TensorSpec("v_out", kv_dim, "act", "kv_cache")
    op("rope_q", "rope", ("q_out",), ("q",), flops=3 * q_dim)
    op("rope_k", "rope", ("k_out",), ("k",), flops=3 * kv_dim)
    # Per token of context: QK^T and PV for every head.
    op("attention", "attention", ("q", "k", "v_out"), ("attn",), flops=4 * q_dim)
    projection("o_proj")
    op("attn_residual", "add", ("x", "o_out"), ("x_mid",), flops=hidden)
    op("post_attention_layernorm", "rmsnorm", ("x_mid",), ("h_mlp",), flops=4 * hidden)
    projection("gate_proj")
    projection("up_proj")
    op("silu_mul", "silu_mul", ("gate_out", "up_out"), ("m",), flops=5 * inter)
    projection("down_proj")
    op("mlp_residual", "add", ("x_mid", "down_out"), ("x_next",), flops=hidden)
    return LayerGraph(ops=tuple(ops), tensors=tensors, bypass=dict(bypass))

"""Llama-family decoder (Llama 2/3/3.1, Qwen2/2.5, Mistral, SmolLM) over one flat token batch.

Module names mirror HF checkpoints (`model.layers.{i}.self_attn.q_proj`, ...), so safetensors load
by name and PEFT target names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) map
1:1 onto separate `nn.Linear`s that the LoRA work wraps one by one.

Per-layer op graph (x: [T, hidden] residual stream; T tokens of any rows, no padding):

    h   = input_layernorm(x)                        rmsnorm (weight only)
    q   = q_proj(h); k = k_proj(h); v = v_proj(h)   linear (+bias on Qwen2 / attention_bias)
    q,k = rope(q, positions), rope(k, positions)    rotate-half, cos/sin shared by all layers
    a   = attention(q, k, v)                        writes k,v to the paged cache, then reads it
    x   = x + o_proj(a)                             linear, residual add
    h   = post_attention_layernorm(x)               rmsnorm
    m   = silu(gate_proj(h)) * up_proj(h)           two linears, silu-and-mul
    x   = x + down_proj(m)                          linear, residual add

After the last layer: model.norm (rmsnorm), then lm_head (tied to embed_tokens when
tie_word_embeddings). The residual adds are fused into the next rmsnorm call (`RMSNorm(x, res)`),
with the same arithmetic as HF's separate adds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flexserve.layers.activation import silu_and_mul
from flexserve.layers.attention import Attention
from flexserve.layers.forward_context import get_forward_context
from flexserve.layers.lora_linear import add_lora
from flexserve.layers.rmsnorm import RMSNorm
from flexserve.layers.rotary import RopeInputs, RotaryEmbedding

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def check_supported(config: Any, max_model_len: int | None = None) -> None:
    """Raise ValueError when the HF config needs something this decoder does not implement."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
    window = getattr(config, "sliding_window", None)
    if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        window = None  # Qwen2 configs carry a window they do not use
    max_len = max_model_len or config.max_position_embeddings
    if window is not None and window < max_len:
        raise ValueError(
            f"sliding_window {window} is smaller than the context length {max_len}; sliding-window "
            f"attention is not supported: set max_model_len <= {window}"
        )


def head_dim_of(config: Any) -> int:
    """config.head_dim when present, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class MergedProjection:
    """Linears reading one input as one GEMM (vLLM's QKV / gate-up merging), for the GPU path.

    `merge` concatenates the projections' weights (and biases) into one tensor and makes each
    projection's Parameter a view of its rows, so checkpoints, LoRA wrappers and fine-tuning keep
    per-projection names and memory is not doubled. Calling it runs the one GEMM, splits the
    output into column slices and adds each projection's LoRA bypass into its slice. A plain
    attribute holder, not a Module: the merged tensor is not a parameter of its own.
    """

    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.sizes: list[int] = []

    @torch.no_grad()
    def merge(self, linears: tuple[nn.Module, ...]) -> None:
        weights = [m.weight for m in linears]
        self.weight = torch.cat([w.data for w in weights])
        biases = [m.bias for m in linears]
        if all(b is not None for b in biases):
            self.bias = torch.cat([b.data for b in biases])
        self.sizes = [w.shape[0] for w in weights]
        start = 0
        for w, b, size in zip(weights, biases, self.sizes):
            w.data = self.weight[start:start + size]
            if self.bias is not None:
                b.data = self.bias[start:start + size]
            start += size

    def __call__(self, x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
        outputs = F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        add_lora(linears, x, outputs)
        return outputs


class LlamaAttention(nn.Module):
    """q/k/v projections, rope, paged attention, o_proj."""

    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        # Qwen2 has biases on q/k/v only; Llama's attention_bias covers o_proj as well.
        qkv_bias = attention_bias or config.model_type == "qwen2"
        o_bias = attention_bias and config.model_type != "qwen2"
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=o_bias)
        self.attn = Attention(num_heads, head_dim, num_kv_heads, scale=head_dim**-0.5)
        self.qkv = MergedProjection()

    def forward(self, hidden: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        if self.qkv.weight is not None:
            q, k, v = self.qkv(hidden, (self.q_proj, self.k_proj, self.v_proj))
            q, k = rope.apply(q, k)
        else:
            q, k = rope.apply(self.q_proj(hidden), self.k_proj(hidden))
            v = self.v_proj(hidden)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.gate_up = MergedProjection()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up.weight is not None:
            gate, up = self.gate_up(x, (self.gate_proj, self.up_proj))
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(silu_and_mul(gate, up))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder layer; see the module docstring for its op graph."""

    def __init__(self, config: Any, head_dim: int, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # index in model.layers; names the layer to fine-tuning capture
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, head_dim)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in, (mlp output, residual before it) out; their sum is the stream."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def forward_captured(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs, capture: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` that hands every named tensor of `flexserve.peft.layer_graph` to `capture`
        (a `FinetuneCapture`, which copies out the fine-tuning rows it stores) as it is made."""
        i, attn, mlp = self.layer_idx, self.self_attn, self.mlp
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        capture.take(i, "x", residual)
        capture.take(i, "h_attn", hidden)
        q, k, v = attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)
        for name, tensor in (("q_out", q), ("k_out", k), ("v_out", v)):
            capture.take(i, name, tensor)
        q, k = rope.apply(q, k)  # in place on the Triton path: q_out and k_out are copied above
        capture.take(i, "q", q)
        capture.take(i, "k", k)
        hidden = attn.attn(q, k, v)
        capture.take(i, "attn", hidden)
        hidden = attn.o_proj(hidden)
        capture.take(i, "o_out", hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        capture.take(i, "x_mid", residual)
        capture.take(i, "h_mlp", hidden)
        gate, up = mlp.gate_proj(hidden), mlp.up_proj(hidden)
        capture.take(i, "gate_out", gate)
        capture.take(i, "up_out", up)
        hidden = silu_and_mul(gate, up)
        capture.take(i, "m", hidden)
        hidden = mlp.down_proj(hidden)
        capture.take(i, "down_out", hidden)
        if capture.wants(i, "x_next"):  # the next layer's x; the model fuses this add into its norm
            capture.take(i, "x_next", residual + hidden)
        return hidden, residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm; rope cos/sin gathered once per forward."""

    def __init__(self, config: Any, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, head_dim, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.from_config(config, head_dim, max_position)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb.prepare(positions, hidden.dtype)
        capture = get_forward_context().finetune
        residual = None
        for layer in self.layers:
            if capture is None:
                hidden, residual = layer(hidden, residual, rope)
            else:
                hidden, residual = layer.forward_captured(hidden, residual, rope, capture)
        hidden, stream = self.norm(hidden, residual)
        if capture is not None:
            capture.take_final(stream)  # the last layer's output, where the window loss starts
        return hidden


class LlamaForCausalLM(nn.Module):
    """The decoder plus lm_head; attention metadata comes from the forward context."""

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        super().__init__()
        check_supported(config, max_model_len)
        self.config = config
        self.head_dim = head_dim_of(config)
        self.num_layers = config.num_hidden_layers
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        max_position = max_model_len or config.max_position_embeddings
        self.model = LlamaModel(config, self.head_dim, max_position)
        if self.tie_word_embeddings:
            # Allocated on meta and replaced at once: a tied head must not cost vocab x hidden.
            with torch.device("meta"):
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        return self.lm_head(hidden).float()

    def merge_projections(self) -> None:
        """q/k/v and gate/up each as one GEMM (GPU path; call after the weights are loaded)."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv.merge((attn.q_proj, attn.k_proj, attn.v_proj))
            mlp.gate_up.merge((mlp.gate_proj, mlp.up_proj))

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Give layer i the cache kv_caches[i] ([2, num_blocks, block_size, KV, D]); [] unbinds."""
        attns = [layer.self_attn.attn for layer in self.model.layers]
        if not kv_caches:
            for attn in attns:
                attn.kv_cache = None
            return
        if len(kv_caches) != len(attns):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(attns)} layers")
        for i, (attn, cache) in enumerate(zip(attns, kv_caches)):
            if cache.dim() != 5 or cache.shape[0] != 2 or tuple(cache.shape[3:]) != (
                attn.num_kv_heads, attn.head_dim
            ):
                raise ValueError(
                    f"KV cache {i} has shape {tuple(cache.shape)}; expected "
                    f"[2, num_blocks, block_size, {attn.num_kv_heads}, {attn.head_dim}]"
                )
            attn.kv_cache = cache

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters by HF name; returns the loaded names.

        Rotary buffers are skipped, as is lm_head.weight of a tied model. Raises ValueError naming
        the missing and unexpected names, or a shape mismatch.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                self.tie_word_embeddings and name == "lm_head.weight"
            ):
                continue
            param = params.get(name)
            if param is None:
                unexpected.append(name)
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"weight {name}: checkpoint shape {tuple(tensor.shape)}, "
                    f"model shape {tuple(param.shape)}"
                )
            param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing or unexpected:
            raise ValueError(
                "checkpoint does not match the model: "
                f"missing {_some(missing)}; unexpected {_some(sorted(unexpected))}"
            )
        return loaded


def _some(names: list[str], limit: int = 10) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return f"{len(names)} ({shown}{', ...' if len(names) > limit else ''})"

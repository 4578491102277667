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

Under tensor parallelism every rank builds this graph over its shard (`tp_layout`): its heads and
intermediate features, one all-reduce after o_proj and one after down_proj, a vocab-parallel
embedding and lm_head.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flexserve.distributed.parallel_state import (
    PipelineStage,
    TensorParallelGroup,
    get_pp_stage,
    get_tp_group,
)
from flexserve.layers.activation import silu_and_mul
from flexserve.layers.attention import Attention
from flexserve.layers.forward_context import get_forward_context
from flexserve.layers.linear import dense
from flexserve.layers.lora_linear import LoRALinear, add_lora, folds_batch, lora_group_forward
from flexserve.layers.rmsnorm import RMSNorm
from flexserve.layers.rotary import RopeInputs, RotaryEmbedding
from flexserve.layers.vocab_parallel_embedding import VocabParallelEmbedding
from flexserve.model.tp_layout import TensorParallelLayout
from flexserve_kernels.lora.serve.folded import FoldedLoRA

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# LoRA A rows folded into a merged GEMM may add at most this fraction of its weight rows: decode
# steps with adapters stream them all (max_loras x max_lora_rank per projection). The defaults
# (4 slots of rank 64) add 12.5% to Llama-3.1-8B's q/k/v GEMM, 6.25% to o and down, 1.8% to
# gate/up: 4.5% of a layer's weight bytes, against 5 extra kernel launches a layer unfolded.
FOLD_MAX_FRACTION = 0.125


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

    `fold_lora` (LoRA on, GPU path) also places every slot's LoRA A rows below the weight rows,
    so a decode-sized batch with adapters gets the base outputs and all shrinks from one GEMM and
    adds the bypass with one expand launch (`flexserve_kernels.lora.serve.expand_folded`), or inside
    the kernel that reads the output next (gate/up: SiLU-and-mul). Larger batches, and batches
    without adapters, multiply by the weight rows only.
    """

    def __init__(self) -> None:
        self.weight: torch.Tensor | None = None  # [sum(sizes), in]: the projections' weights
        self.bias: torch.Tensor | None = None
        self.sizes: list[int] = []
        self.folded: torch.Tensor | None = None  # weight rows, then P x num_slots x max_rank A rows
        self.folded_bias: torch.Tensor | None = None  # bias, then zeros for the A rows
        self.lora_b: torch.Tensor | None = None  # [num_slots, sum(sizes), max_rank]: B side by side
        self.scaling: torch.Tensor | None = None  # [P, num_slots] float32

    @torch.no_grad()
    def merge(self, linears: tuple[nn.Module, ...]) -> None:
        weights = [m.weight for m in linears]
        self.weight = torch.cat([w.data for w in weights])
        biases = [m.bias for m in linears]
        if all(b is not None for b in biases):
            self.bias = torch.cat([b.data for b in biases])
        self.sizes = [w.shape[0] for w in weights]
        self._point_views(linears, self.weight, self.bias)

    @torch.no_grad()
    def fold_lora(self, linears: tuple[nn.Module, ...], max_fraction: float) -> bool:
        """Fold the `LoRALinear`s' slot A rows into the GEMM (merging first if needed) when they add
        at most `max_fraction` of the weight rows; returns whether it did. Each linear's `lora_a`,
        `lora_b` and `scaling` become views of the group's tensors, so slot loads land in them."""
        num_slots, max_rank = linears[0].max_loras, linears[0].max_rank
        if any((m.max_loras, m.max_rank) != (num_slots, max_rank) for m in linears):
            raise ValueError("a merged group's LoRA linears must share max_loras and max_rank")
        lora_rows = num_slots * max_rank
        if len(linears) * lora_rows > max_fraction * sum(m.out_features for m in linears):
            return False
        if self.weight is None:
            self.merge(linears)
        num_rows, in_features = self.weight.shape
        like = dict(device=self.weight.device, dtype=self.weight.dtype)
        folded = torch.empty(num_rows + len(linears) * lora_rows, in_features, **like)
        folded[:num_rows].copy_(self.weight)
        lora_b = torch.empty(num_slots, num_rows, max_rank, **like)
        scaling = torch.empty(len(linears), num_slots, device=self.weight.device, dtype=torch.float32)
        start = 0
        for p, (module, size) in enumerate(zip(linears, self.sizes)):
            rows = num_rows + p * lora_rows
            lora_a = folded[rows:rows + lora_rows].view(num_slots, max_rank, in_features)
            lora_a.copy_(module.lora_a)
            lora_b[:, start:start + size].copy_(module.lora_b)
            scaling[p].copy_(module.scaling)
            module.lora_a, module.lora_b = lora_a, lora_b[:, start:start + size]
            module.scaling = scaling[p]
            start += size
        if self.bias is not None:
            self.folded_bias = torch.cat([self.bias, self.bias.new_zeros(folded.shape[0] - num_rows)])
        self.folded, self.lora_b, self.scaling = folded, lora_b, scaling
        self._point_views(linears, folded[:num_rows],
                          None if self.bias is None else self.folded_bias[:num_rows])
        return True

    def _point_views(self, linears: tuple[nn.Module, ...], weight: torch.Tensor,
                     bias: torch.Tensor | None) -> None:
        """Make the group's weight (and bias) `weight`, each linear's Parameters views of its rows."""
        self.weight, self.bias = weight, bias
        start = 0
        for m, size in zip(linears, self.sizes):
            m.weight.data = weight[start:start + size]
            if bias is not None:
                m.bias.data = bias[start:start + size]
            start += size

    def project(
        self, x: torch.Tensor, linears: tuple[nn.Module, ...]
    ) -> tuple[torch.Tensor, FoldedLoRA | None]:
        """(y, bypass): the group's output y [T, sum(sizes)] and, for a decode-sized batch with
        adapters through the folded GEMM, its LoRA bypass still to be expanded into y (by the
        caller's consumer kernel or `FoldedLoRA.expand`); otherwise the bypass is added, None."""
        meta = get_forward_context().lora_meta
        if self.folded is not None:
            if meta is not None and meta.has_lora and folds_batch(x, meta):
                out = dense(x, self.folded, self.folded_bias)
                num_rows = self.weight.shape[0]
                if not any(m.has_weights_for(meta) for m in linears):
                    return out[:, :num_rows], None
                return out[:, :num_rows], FoldedLoRA(out[:, num_rows:], self.lora_b, self.scaling,
                                                     meta.token_slots, tuple(self.sizes))
        y = None if self.bias is not None else lora_group_forward(linears, x, self.weight, meta)
        if y is None:
            y = dense(x, self.weight, self.bias)
            add_lora(linears, x, y.split(self.sizes, dim=-1), meta)
        return y, None

    def __call__(self, x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
        """The projections' outputs (column slices of one tensor), LoRA bypasses added."""
        y, bypass = self.project(x, linears)
        if bypass is not None:
            # Imported here: the folded expand is a Triton kernel, and folding happens only on CUDA.
            from flexserve_kernels.lora.serve.expand_folded import expand_bypass

            expand_bypass(bypass, y)
        return y.split(self.sizes, dim=-1)


class LlamaAttention(nn.Module):
    """q/k/v projections, rope, paged attention, o_proj; under tensor parallelism this rank's
    heads, with o_proj's partial outputs summed over the ranks."""

    def __init__(self, config: Any, layout: TensorParallelLayout, tp: TensorParallelGroup) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, layout.head_dim
        num_heads, num_kv_heads = layout.num_local_heads, layout.num_local_kv_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        # Qwen2 has biases on q/k/v only; Llama's attention_bias covers o_proj as well.
        qkv_bias = attention_bias or config.model_type == "qwen2"
        o_bias = attention_bias and config.model_type != "qwen2"
        self.head_dim = head_dim
        self.tp = tp
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=o_bias)
        self.attn = Attention(num_heads, head_dim, num_kv_heads, scale=head_dim**-0.5)
        self.qkv = MergedProjection()
        self.o = MergedProjection()  # o_proj alone; used once LoRA shrinks are folded into it

    def forward(self, hidden: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        if self.qkv.weight is not None:  # the Triton path: rope is fused with the KV write
            q, k, v = self.qkv(hidden, (self.q_proj, self.k_proj, self.v_proj))
            hidden = self.attn(q, k, v, rope)
        else:
            q, k = rope.apply(self.q_proj(hidden), self.k_proj(hidden))
            hidden = self.attn(q, k, self.v_proj(hidden))
        if self.o.weight is not None:
            return self.tp.all_reduce(self.o(hidden, (self.o_proj,))[0])
        return self.tp.all_reduce(self.o_proj(hidden))


class LlamaMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)); under tensor parallelism this rank's slice of
    the intermediate features, with down_proj's partial outputs summed over the ranks."""

    def __init__(self, config: Any, layout: TensorParallelLayout, tp: TensorParallelGroup) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        hidden, intermediate = config.hidden_size, layout.local_intermediate_size
        self.tp = tp
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up = MergedProjection()
        self.down = MergedProjection()  # down_proj alone; used once LoRA shrinks are folded into it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A folded gate/up LoRA bypass is expanded inside the SiLU-and-mul kernel."""
        bypass = None
        if self.gate_up.weight is not None:
            y, bypass = self.gate_up.project(x, (self.gate_proj, self.up_proj))
            gate, up = y.split(self.gate_up.sizes, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        hidden = silu_and_mul(gate, up, lora=bypass)
        if self.down.weight is not None:
            return self.tp.all_reduce(self.down(hidden, (self.down_proj,))[0])
        return self.tp.all_reduce(self.down_proj(hidden))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder layer; see the module docstring for its op graph."""

    def __init__(self, config: Any, layout: TensorParallelLayout, tp: TensorParallelGroup,
                 layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # index in model.layers; names the layer to fine-tuning capture
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layout, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, layout, tp)

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

    # A step with fine-tuning windows runs under no_grad, not inference_mode, since its activation
    # stores outlive it; but what this layer makes leaves it only as copies (into the stores and
    # the KV cache, normal tensors), and outside it only through out-of-place ops, so its ops can
    # skip autograd's bookkeeping: 1.2-1.5 ms of a 64-token window step of a 32-layer down_proj
    # job, 2-5 ms with all 7 targets (CPU, benchmarks/finetune_host_overhead.py).
    @torch.inference_mode()
    def forward_captured(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs, capture: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` that hands every named tensor of `flexserve.peft.layer_graph` to `capture`
        (a `FinetuneCapture`, which copies out the fine-tuning rows it stores) as it is made.
        Its outputs are inference tensors: read them, never update them in place."""
        i, attn, mlp = self.layer_idx, self.self_attn, self.mlp
        meta = get_forward_context().lora_meta
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        capture.take(i, "x", residual)
        capture.take(i, "h_attn", hidden)
        q, k, v = _project_captured(attn.qkv, (attn.q_proj, attn.k_proj, attn.v_proj), hidden,
                                    meta, capture)
        capture.take(i, "q_out", q)
        capture.take(i, "k_out", k)
        capture.take(i, "v_out", v)
        q, k = rope.apply(q, k)  # in place on the Triton path: q_out and k_out are copied above
        capture.take(i, "q", q)
        capture.take(i, "k", k)
        hidden = attn.attn(q, k, v)
        capture.take(i, "attn", hidden)
        # Row-parallel outputs (and their partial LoRA deltas) are summed over the ranks before
        # they are kept: the stored o_out and down_out are whole, as on one rank.
        hidden = attn.tp.all_reduce(
            _project_captured(attn.o, (attn.o_proj,), hidden, meta, capture)[0])
        capture.take(i, "o_out", hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        capture.take(i, "x_mid", residual)
        capture.take(i, "h_mlp", hidden)
        gate, up = _project_captured(mlp.gate_up, (mlp.gate_proj, mlp.up_proj), hidden, meta,
                                     capture)
        capture.take(i, "gate_out", gate)
        capture.take(i, "up_out", up)
        hidden = silu_and_mul(gate, up)
        capture.take(i, "m", hidden)
        hidden = mlp.tp.all_reduce(
            _project_captured(mlp.down, (mlp.down_proj,), hidden, meta, capture)[0])
        capture.take(i, "down_out", hidden)
        if capture.wants(i, "x_next"):  # the next layer's x; the model fuses this add into its norm
            capture.take(i, "x_next", residual + hidden)
        return hidden, residual


def _project_captured(group: MergedProjection, linears: tuple[nn.Module, ...], x: torch.Tensor,
                      meta: Any, capture: Any) -> Sequence[torch.Tensor]:
    """The projections' outputs under a fine-tuning capture, each with its LoRA bypass added
    and its tensors handed to `capture` (`LoRALinear.add_captured_bypass`): on the merged (GPU)
    path column slices of one GEMM over the group's weight rows, as in `forward` (LoRAFusion's
    kernels where `lora_group_forward` takes the batch); otherwise one
    `F.linear` per projection, the arithmetic of calling them, without a module call each."""
    if group.weight is not None:
        if group.bias is None:
            y = lora_group_forward(linears, x, group.weight, meta, capture)
            if y is not None:
                return y.split(group.sizes, dim=-1)
        outputs = F.linear(x, group.weight, group.bias).split(group.sizes, dim=-1)
    else:
        outputs = [F.linear(x, m.weight, m.bias) for m in linears]
    if isinstance(linears[0], LoRALinear):
        for module, y in zip(linears, outputs):
            module.add_captured_bypass(x, y, meta, capture)
    return outputs


class PPMissingLayer(nn.Module):
    """The place of a decoder layer that another pipeline stage holds: the layer indices (and
    the checkpoint names they give) stay those of the whole model."""


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm; rope cos/sin gathered once per forward.

    A pipeline stage (`stage`) holds its decoder layers only (the others are `PPMissingLayer`s),
    the first stage the embedding and the last the final norm: a stage other than the first
    starts from the previous stage's (hidden, residual), and one other than the last returns
    its own for the next."""

    def __init__(self, config: Any, layout: TensorParallelLayout, tp: TensorParallelGroup,
                 max_position: int, stage: PipelineStage | None = None) -> None:
        super().__init__()
        stage = PipelineStage() if stage is None else stage
        self.is_first, self.is_last = stage.is_first, stage.is_last
        self.first_layer, self.end_layer = stage.layer_range(config.num_hidden_layers)
        self.embed_tokens: nn.Module | None = None
        if self.is_first and tp.world_size == 1:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        elif self.is_first:
            self.embed_tokens = VocabParallelEmbedding(
                layout.vocab_per_rank, config.hidden_size, layout.vocab_start, layout.vocab_end, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, layout, tp, i)
            if self.first_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        # The decoder layers this stage holds, in order (once: every forward walks them).
        self.local_layers: tuple[nn.Module, ...] = tuple(
            self.layers[self.first_layer:self.end_layer])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last else None
        self.rotary_emb = RotaryEmbedding.from_config(config, layout.head_dim, max_position)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        rope = self.rotary_emb.prepare(positions, hidden.dtype)
        capture = get_forward_context().finetune
        for layer in self.local_layers:
            if capture is None:
                hidden, residual = layer(hidden, residual, rope)
            else:
                hidden, residual = layer.forward_captured(hidden, residual, rope, capture)
        if not self.is_last:
            return hidden, residual
        hidden, stream = self.norm(hidden, residual)
        if capture is not None:
            capture.take_final(stream)  # the last layer's output, where the window loss starts
        return hidden


class LlamaForCausalLM(nn.Module):
    """The decoder plus lm_head; attention metadata comes from the forward context.

    Under tensor parallelism (`tp`, by default this process's group) it holds this rank's shard
    of every weight (`TensorParallelLayout`), and its logits are gathered from all ranks. Under
    pipeline parallelism (`stage`, by default this process's) it holds its stage's layers, and
    lm_head on the last stage only (a tied one loaded from the embedding's checkpoint rows)."""

    def __init__(self, config: Any, max_model_len: int | None = None,
                 tp: TensorParallelGroup | None = None,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        check_supported(config, max_model_len)
        self.config = config
        self.tp = get_tp_group() if tp is None else tp
        self.stage = get_pp_stage() if stage is None else stage
        self.head_dim = head_dim_of(config)
        self.layout = TensorParallelLayout.from_config(config, self.head_dim, self.tp.rank,
                                                       self.tp.world_size)
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        max_position = max_model_len or config.max_position_embeddings
        self.model = LlamaModel(config, self.layout, self.tp, max_position, self.stage)
        head_rows = config.vocab_size if self.tp.world_size == 1 else self.layout.vocab_per_rank
        self.lm_head: nn.Linear | None = None
        if self.stage.is_last and self.tie_word_embeddings and self.stage.is_first:
            # Allocated on meta and replaced at once: a tied head must not cost vocab x hidden.
            with torch.device("meta"):
                self.lm_head = nn.Linear(config.hidden_size, head_rows, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight
        elif self.stage.is_last:
            self.lm_head = nn.Linear(config.hidden_size, head_rows, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] int64, positions [T] int64 -> final hidden states [T, hidden]; on a
        pipeline stage other than the last, its (hidden, residual) for the next stage, and on
        one other than the first starting from the previous stage's `intermediate`."""
        return self.model(input_ids, positions, intermediate)

    def holds_weight(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this pipeline stage."""
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            return self.model.first_layer <= index < self.model.end_layer
        if name.startswith("model.embed_tokens."):
            return self.stage.is_first or (self.stage.is_last and self.tie_word_embeddings)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.stage.is_last
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32, the same on every rank."""
        logits = dense(hidden, self.lm_head.weight, self.lm_head.bias, out_dtype=torch.float32)
        if self.tp.world_size == 1:
            return logits
        logits = self.tp.all_gather(logits, dim=-1)
        return logits if logits.shape[-1] == self.vocab_size else logits[:, :self.vocab_size]

    def merge_projections(self) -> None:
        """q/k/v and gate/up each as one GEMM, o and down as groups of one (GPU path; call after
        the weights are loaded): every projection then runs through `MergedProjection.project`."""
        for layer in self.model.local_layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv.merge((attn.q_proj, attn.k_proj, attn.v_proj))
            attn.o.merge((attn.o_proj,))
            mlp.gate_up.merge((mlp.gate_proj, mlp.up_proj))
            mlp.down.merge((mlp.down_proj,))

    def fold_lora_shrinks(self, max_fraction: float = FOLD_MAX_FRACTION) -> int:
        """Fold the LoRA slots' A rows into the merged GEMMs (q/k/v, o, gate/up, down) of every
        layer where they add at most `max_fraction` of a group's rows; call after `LoRALinear`s
        replace the projections, on the merged (GPU) path. Returns the number of groups folded."""
        if self.model.local_layers[0].self_attn.qkv.weight is None:
            return 0
        folded = 0
        for layer in self.model.local_layers:
            attn, mlp = layer.self_attn, layer.mlp
            for group, linears in ((attn.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)),
                                   (attn.o, (attn.o_proj,)),
                                   (mlp.gate_up, (mlp.gate_proj, mlp.up_proj)),
                                   (mlp.down, (mlp.down_proj,))):
                folded += group.fold_lora(linears, max_fraction)
        return folded

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Give this stage's layer i the cache kv_caches[i] ([2, num_blocks, block_size, KV,
        D]); [] unbinds."""
        attns = [layer.self_attn.attn for layer in self.model.local_layers]
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

    def checkpoint_index(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """The part of checkpoint tensor `name` (of `shape`) this rank holds; None: all of it.
        `load_weights` takes tensors cut this way."""
        return self.layout.checkpoint_index(name, shape)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters by HF name; returns the loaded names.

        Under tensor parallelism each tensor is this rank's part (`checkpoint_index`): a
        vocabulary shard shorter than the parameter fills its first rows (the rest are zero
        padding), and ranks other than 0 zero the row-parallel biases. Rotary buffers are
        skipped, as is lm_head.weight of a tied model. Raises ValueError naming the missing and
        unexpected names, or a shape mismatch.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        # The last pipeline stage of a tied model holds lm_head without the embedding: it is
        # loaded from the embedding's checkpoint rows.
        head_from_embedding = (self.tie_word_embeddings and self.lm_head is not None
                               and self.model.embed_tokens is None)
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                self.tie_word_embeddings and name == "lm_head.weight"
            ) or not self.holds_weight(name):
                continue
            if head_from_embedding and name == "model.embed_tokens.weight":
                name = "lm_head.weight"
            param = params.get(name)
            if param is None:
                unexpected.append(name)
                continue
            target = param
            if self.layout.is_vocab_parallel(name) and tensor.shape[0] < param.shape[0]:
                param[tensor.shape[0]:].zero_()
                target = param[:tensor.shape[0]]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"weight {name}: checkpoint shape {tuple(tensor.shape)}, "
                    f"model shape {tuple(param.shape)}"
                )
            if self.layout.holds_bias(name):
                target.copy_(tensor)
            else:
                target.zero_()
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

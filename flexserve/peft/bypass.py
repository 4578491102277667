"""Bypass networks (FlexLLM section 4.1): Y = f_B(X) + f_A(X).

f_B is a frozen backbone linear of a decoder layer; f_A is a small trainable side network attached
to it, reading the same input and adding to the same output. Because f_A never changes f_B, one
backbone serves any number of bypass networks at once: each token adds its own network's f_A
(`flexserve.layers.lora_linear` batches that), and fine-tuning computes gradients for f_A alone.
LoRA (`flexserve.peft.lora`) is the first kind: f_A(X) = scaling * (X A^T) B^T.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

# The backbone linears a bypass network may attach to, with their parent module in a decoder
# layer (the HF / PEFT module path is `model.layers.{i}.{parent}.{target}`).
TARGET_MODULES: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def target_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every target linear of a Llama-family config."""
    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q_out = hf_config.num_attention_heads * head_dim
    kv_out = hf_config.num_key_value_heads * head_dim
    inter = hf_config.intermediate_size
    return {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def check_placement(layer: int, target: str, shapes: dict[str, tuple[int, int]],
                    num_layers: int) -> tuple[int, int]:
    """ValueError unless the model has `layer` and a `target` linear; returns its (in, out)."""
    if not 0 <= layer < num_layers:
        raise ValueError(
            f"the adapter has weights for layer {layer}; the model has {num_layers} layers")
    if target not in shapes:
        raise ValueError(f"the model has no {target} to attach to")
    return shapes[target]


def move_tensor(t: torch.Tensor, device: torch.device | str | None, dtype: torch.dtype | None,
                pin_memory: bool) -> torch.Tensor:
    """`t` moved/cast and contiguous; pinned host memory speeds later copies to the GPU."""
    t = t.to(device=device, dtype=dtype).contiguous()
    return t.pin_memory() if pin_memory else t


class BypassNetwork(abc.ABC):
    """A side network f_A attached to some backbone linears of every decoder layer."""

    kind: ClassVar[str]  # e.g. "lora"

    @property
    @abc.abstractmethod
    def target_modules(self) -> tuple[str, ...]:
        """Names (keys of TARGET_MODULES) of the backbone linears it attaches to."""

    @abc.abstractmethod
    def attached(self, layer: int, target: str) -> bool:
        """Whether it has a network on this layer's `target` linear."""

    @abc.abstractmethod
    def delta(self, layer: int, target: str, x: torch.Tensor) -> torch.Tensor:
        """f_A(x) for one attached linear, x [..., in] -> [..., out] (unbatched reference)."""

    @abc.abstractmethod
    def check_compatible(
        self, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int | None = None
    ) -> None:
        """ValueError unless it fits a backbone with these target shapes and layer count."""

    def forward(self, layer: int, target: str, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """Y = f_B(X) + f_A(X), given f_B(X) as `base`."""
        if not self.attached(layer, target):
            return base
        return base + self.delta(layer, target, x).to(base.dtype)

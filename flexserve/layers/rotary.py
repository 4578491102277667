"""Rotary position embedding (neox-style rotate-half, as HF Llama) with HF's frequency scalings.

Settings come from transformers-5 `config.rope_parameters` (rope_type, rope_theta, factor, ...)
or, for older configs, `config.rope_theta` / `config.rope_scaling`. Supported rope types:
"default", "linear", "llama3" (Llama 3.1) and "yarn"; their inverse frequencies follow HF's
`modeling_rope_utils` exactly. cos/sin are precomputed once in fp32 for every position and
gathered at the step's positions once per forward, then shared by all layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flexserve_kernels.dispatch import use_triton

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_DEFAULT_THETA = 10000.0


def get_rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rope settings as one flat dict that always has rope_type and rope_theta."""
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.update(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type")) or "default"
    theta = params.get("rope_theta")
    if theta is None:
        theta = getattr(config, "rope_theta", None)
    params["rope_type"] = rope_type
    params["rope_theta"] = float(theta if theta is not None else _DEFAULT_THETA)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
    return params


def _require(params: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if params.get(k) is None]
    if missing:
        raise ValueError(f"rope_type {params['rope_type']!r} needs rope parameters {missing}")


def compute_inv_freq(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """HF's (inv_freq [head_dim // 2] fp32, attention_scaling) for `get_rope_parameters` output."""
    rope_type = params["rope_type"]
    base = params["rope_theta"]
    dim = head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        _require(params, "factor")
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        _require(params, "factor", "low_freq_factor", "high_freq_factor")
        return _llama3_inv_freq(inv_freq, params, max_position_embeddings), 1.0
    return _yarn_inv_freq(params, dim, max_position_embeddings)


def _llama3_inv_freq(
    inv_freq: torch.Tensor, params: dict[str, Any], max_position_embeddings: int
) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params.get("original_max_position_embeddings") or max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    params: dict[str, Any], dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    # YaRN: interpolate low frequencies, extrapolate high ones, linear ramp between; cos/sin are
    # scaled by an attention factor that grows with log(factor).
    base = params["rope_theta"]
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, 1, D // 2] (x's dtype): HF's x*cos + rotate_half(x)*sin."""
    x1, x2 = x.chunk(2, dim=-1)
    # Same products and sums as HF's concatenated form, so fp32 results are bitwise equal.
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """fp32 cos/sin cache for positions [0, max_position); gathers and applies it."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
    ) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        self.attention_scaling = attention_scaling
        # Computed on the CPU so values do not depend on the device, then moved to the ambient
        # default device (the loader builds the model under `with torch.device(...)`).
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = t[:, None] * inv_freq.to(device="cpu", dtype=torch.float32)[None, :]
        cache = torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), -1)
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device()), persistent=False)

    @classmethod
    def from_config(
        cls, config: Any, head_dim: int, max_position: int | None = None
    ) -> RotaryEmbedding:
        """Rotary for an HF config; the cache covers `max_position` (default: the config's)."""
        max_len = config.max_position_embeddings
        inv_freq, scaling = compute_inv_freq(get_rope_parameters(config), head_dim, max_len)
        return cls(head_dim, max_position or max_len, inv_freq, scaling)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        """What every layer's rotation of this forward needs; built once per forward."""
        if use_triton(positions.device):
            return RopeInputs(positions, self.cos_sin_cache, self.head_dim)
        cos, sin = self.get_cos_sin(positions, dtype)
        return RopeInputs(positions, self.cos_sin_cache, self.head_dim, cos, sin)

    def get_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D // 2] in `dtype` at positions [T] (int64); reused by every layer."""
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        cos, sin = cos_sin.chunk(2, dim=-1)
        return cos, sin

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, H*D] and key [T, KV*D] at positions [T]; returns the same shapes."""
        cos, sin = self.get_cos_sin(positions, query.dtype)
        return rotate(query, cos, sin, self.head_dim), rotate(key, cos, sin, self.head_dim)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"


@dataclass(slots=True)
class RopeInputs:
    """One forward's rotary inputs: positions and the fp32 cache for the in-place Triton kernel,
    or cos/sin gathered once (torch path)."""

    positions: torch.Tensor  # [T] int64
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] float32: cos | sin
    head_dim: int
    cos: torch.Tensor | None = None  # [T, 1, head_dim // 2] on the torch path
    sin: torch.Tensor | None = None

    def apply(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, H*D] and key [T, KV*D]; the Triton path rotates them in place."""
        if self.cos is None:
            from flexserve_kernels.norm_rope.rotary import rotary_embedding

            return rotary_embedding(self.positions, query, key, self.cos_sin_cache, self.head_dim)
        return (rotate(query, self.cos, self.sin, self.head_dim),
                rotate(key, self.cos, self.sin, self.head_dim))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`apply_rotary_emb` on a flat [T, N*head_dim] projection output; returns the flat shape."""
    num_tokens = x.shape[0]
    return apply_rotary_emb(x.view(num_tokens, -1, head_dim), cos, sin).view(num_tokens, -1)

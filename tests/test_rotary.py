"""Rotary embedding vs HF's rotary classes for every supported rope type."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from flexserve.layers.rotary import RotaryEmbedding, compute_inv_freq, get_rope_parameters

HEAD_DIM = 32
_SMALL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

CASES = {
    "default": (LlamaConfig, dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "legacy-rope-theta": (LlamaConfig, dict(rope_theta=500000.0)),
    "linear": (LlamaConfig, dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                  "factor": 4.0})),
    # original_max_position_embeddings 32 puts head_dim 32's frequencies in all three llama3
    # regimes (kept, divided by factor, smoothed).
    "llama3": (LlamaConfig, dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama3-legacy-rope-scaling": (LlamaConfig, dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "yarn": (LlamaConfig, dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64})),
    "yarn-untruncated-betas": (LlamaConfig, dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0, "beta_fast": 16.0,
        "beta_slow": 2.0, "truncate": False, "original_max_position_embeddings": 32})),
    "yarn-mscale": (LlamaConfig, dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 0.5, "original_max_position_embeddings": 64})),
    "qwen2": (Qwen2Config, dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


def _hf_rotary(config):
    cls = Qwen2RotaryEmbedding if config.model_type == "qwen2" else LlamaRotaryEmbedding
    return cls(config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_hf_rotary(case):
    config_cls, kwargs = CASES[case]
    config = config_cls(**_SMALL, **kwargs)
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_heads, num_kv_heads = 50, 4, 2
    positions = torch.randint(0, config.max_position_embeddings, (num_tokens,), generator=gen)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)

    hf = _hf_rotary(config)
    cos, sin = hf(q, positions[None])
    # HF layout is [batch, heads, seq, dim].
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ref, k_ref = q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)

    ours = RotaryEmbedding.from_config(config, HEAD_DIM)
    inv_freq, scaling = compute_inv_freq(get_rope_parameters(config), HEAD_DIM,
                                         config.max_position_embeddings)
    torch.testing.assert_close(inv_freq, hf.inv_freq, atol=0, rtol=0)
    assert scaling == pytest.approx(hf.attention_scaling, rel=1e-12)
    q_out, k_out = ours(positions, q.reshape(num_tokens, -1), k.reshape(num_tokens, -1))
    torch.testing.assert_close(q_out.view_as(q), q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out.view_as(k), k_ref, atol=1e-6, rtol=1e-6)


def test_cache_is_fp32_and_not_in_state_dict():
    config = LlamaConfig(**_SMALL)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            rope = RotaryEmbedding.from_config(config, HEAD_DIM, max_position=100)
        finally:
            torch.set_default_dtype(torch.float32)
    assert rope.cos_sin_cache.dtype == torch.float32
    assert rope.cos_sin_cache.shape == (100, HEAD_DIM)
    assert "cos_sin_cache" not in rope.state_dict()
    cos, sin = rope.get_cos_sin(torch.tensor([0, 99]), torch.bfloat16)
    assert cos.shape == (2, 1, HEAD_DIM // 2) and cos.dtype == torch.bfloat16
    assert torch.all(cos[0] == 1) and torch.all(sin[0] == 0)


def test_reads_old_and_new_config_styles():
    old = SimpleNamespace(rope_theta=123.0, max_position_embeddings=8)
    assert get_rope_parameters(old) == {"rope_type": "default", "rope_theta": 123.0}
    old_scaling = SimpleNamespace(rope_theta=5.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert get_rope_parameters(old_scaling) == {"type": "linear", "factor": 2.0,
                                                "rope_type": "linear", "rope_theta": 5.0}
    new = SimpleNamespace(rope_parameters={"rope_type": "llama3", "rope_theta": 7.0, "factor": 8.0})
    assert get_rope_parameters(new)["rope_theta"] == 7.0
    assert get_rope_parameters(SimpleNamespace())["rope_theta"] == 10000.0


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "mrope"])
def test_unsupported_rope_type_is_named(rope_type):
    config = SimpleNamespace(rope_parameters={"rope_type": rope_type, "rope_theta": 1.0})
    with pytest.raises(ValueError, match=rope_type):
        get_rope_parameters(config)


def test_missing_scaling_parameters_are_named():
    params = get_rope_parameters(SimpleNamespace(rope_parameters={"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(ValueError, match="low_freq_factor"):
        compute_inv_freq(params, HEAD_DIM, 128)


def test_partial_rotary_factor_is_rejected():
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        get_rope_parameters(SimpleNamespace(partial_rotary_factor=0.5))

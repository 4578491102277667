"""PEFT format in and out: a round trip through the `peft` library, and a ValueError that names the
problem for every kind of adapter directory the server must refuse."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from flexserve.peft.bypass import TARGET_MODULES, target_shapes
from flexserve.peft.lora import LoRAAdapter, lora_scaling
from flexserve.peft.peft_io import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    load_peft_adapter,
    resolve_adapter_dir,
    save_peft_adapter,
)

ALL_TARGETS = list(TARGET_MODULES)


@pytest.fixture(scope="module")
def config(tiny_config):
    return tiny_config("llama")


@pytest.fixture
def peft_model(config):
    """A tiny HF Llama with a random rsLoRA adapter (non-zero B) on all seven projections."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(
        r=4, lora_alpha=16, target_modules=ALL_TARGETS, use_rslora=True, lora_dropout=0.1))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return model.eval()


def write(path, adapter: LoRAAdapter, **config_changes) -> str:
    save_peft_adapter(adapter, str(path))
    if config_changes:
        config_path = os.path.join(path, ADAPTER_CONFIG_NAME)
        with open(config_path) as f:
            data = json.load(f)
        data.update(config_changes)
        with open(config_path, "w") as f:
            json.dump(data, f)
    return str(path)


def small_adapter(config, rank: int = 4, targets=("q_proj", "v_proj")) -> LoRAAdapter:
    adapter = LoRAAdapter.create(target_shapes(config), config.num_hidden_layers, rank, 8.0,
                                 targets, generator=torch.Generator().manual_seed(1))
    for _a, b in adapter.weights.values():
        b.normal_(0.0, 0.05)
    return adapter


def peft_tensors(adapter: LoRAAdapter, halves: str = "AB") -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's key names."""
    tensors = {}
    for (layer, target), pair in adapter.weights.items():
        prefix = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[target]}.{target}"
        for half, tensor in zip("AB", pair):
            if half in halves:
                tensors[f"{prefix}.lora_{half}.weight"] = tensor
    return tensors


def load(path, config, **kwargs) -> LoRAAdapter:
    return load_peft_adapter(str(path), target_shapes(config), config.num_hidden_layers, **kwargs)


def test_round_trip_through_the_peft_library(peft_model, config, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model.save_pretrained(tmp_path / "from_peft")
    adapter = load(tmp_path / "from_peft", config, max_rank=8)
    assert adapter.rank == 4 and adapter.lora_alpha == 16 and adapter.use_rslora
    assert adapter.scaling == pytest.approx(16 / 2) == lora_scaling(4, 16, True)
    assert adapter.lora_dropout == pytest.approx(0.1)
    assert adapter.target_modules == tuple(ALL_TARGETS)
    assert len(adapter.weights) == config.num_hidden_layers * 7

    # Our bypass equals PEFT's on one module: Y = f_B(X) + f_A(X).
    peft_layer = peft_model.base_model.model.model.layers[1].mlp.down_proj
    x = torch.randn(5, config.intermediate_size)
    with torch.no_grad():
        base = peft_layer.base_layer(x)
        expected = peft_layer(x)
    torch.testing.assert_close(adapter.forward(1, "down_proj", x, base), expected)

    save_peft_adapter(adapter, str(tmp_path / "from_us"), base_model_name_or_path="tiny")
    again = load(tmp_path / "from_us", config)
    for key, (a, b) in adapter.weights.items():
        assert torch.equal(again.weights[key][0], a) and torch.equal(again.weights[key][1], b)

    torch.manual_seed(0)  # the same base weights as the fixture's model
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reloaded = PeftModel.from_pretrained(fresh, str(tmp_path / "from_us")).eval()
    assert reloaded.peft_config["default"].use_rslora
    ids = torch.tensor([[1, 5, 9, 200, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, peft_model(ids).logits)
        with reloaded.disable_adapter():  # and the adapter really changes the model
            assert not torch.allclose(reloaded(ids).logits, peft_model(ids).logits, atol=1e-3)


def test_adapter_saved_from_a_bare_decoder_and_named_adapter_keys_load(config, tmp_path):
    adapter = small_adapter(config)
    path = tmp_path / "bare"
    write(path, adapter)
    tensors = {}
    for (layer, target), (a, b) in adapter.weights.items():
        prefix = f"base_model.model.layers.{layer}.{TARGET_MODULES[target]}.{target}"
        tensors[f"{prefix}.lora_A.default.weight"] = a
        tensors[f"{prefix}.lora_B.default.weight"] = b
    save_file(tensors, str(path / ADAPTER_WEIGHTS_NAME))
    loaded = load(path, config)
    assert loaded.weights.keys() == adapter.weights.keys()


def test_dtype_cast_on_load(config, tmp_path):
    path = write(tmp_path / "a", small_adapter(config))
    loaded = load(path, config, dtype=torch.bfloat16)
    assert all(a.dtype == b.dtype == torch.bfloat16 for a, b in loaded.weights.values())


def test_missing_files(config, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load(tmp_path / "nope", config)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        load(tmp_path / "file", config)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="adapter_config.json is missing"):
        load(tmp_path / "empty", config)
    path = write(tmp_path / "no_weights", small_adapter(config))
    os.remove(os.path.join(path, ADAPTER_WEIGHTS_NAME))
    with pytest.raises(ValueError, match="adapter_model.safetensors is missing"):
        load(path, config)
    open(os.path.join(path, "adapter_model.bin"), "wb").close()
    with pytest.raises(ValueError, match="pickle"):
        load(path, config)


def test_malformed_config_and_weights(config, tmp_path):
    path = write(tmp_path / "a", small_adapter(config))
    config_path = os.path.join(path, ADAPTER_CONFIG_NAME)
    with open(config_path, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="cannot read .*adapter_config.json"):
        load(path, config)
    with open(config_path, "w") as f:
        json.dump(["r", 4], f)
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load(path, config)
    path = write(tmp_path / "b", small_adapter(config), r="four")
    with pytest.raises(ValueError, match="r must be a positive integer"):
        load(path, config)
    path = write(tmp_path / "c", small_adapter(config))
    with open(os.path.join(path, ADAPTER_WEIGHTS_NAME), "wb") as f:
        f.write(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ValueError, match="cannot read .*adapter_model.safetensors"):
        load(path, config)


@pytest.mark.parametrize("change, reason", [
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
    ({"use_dora": True}, r"DoRA \(use_dora\) is not supported"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"lora_bias": True}, "lora_bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "unsupported LoRA target.*embed_tokens"),
    ({"target_modules": ["lm_head"]}, "unsupported LoRA target module.*lm_head"),
])
def test_unsupported_configs(config, tmp_path, change, reason):
    path = write(tmp_path / "a", small_adapter(config), **change)
    with pytest.raises(ValueError, match=reason):
        load(path, config)


def test_unsupported_tensors(config, tmp_path):
    adapter = small_adapter(config)
    cases = {
        "base_model.model.lm_head.lora_A.weight": "LM head",
        "base_model.model.model.embed_tokens.lora_embedding_A": "embeddings",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": "DoRA",
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias": "unexpected tensor",
        "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": "targets mlp.q_proj",
    }
    for i, (key, reason) in enumerate(cases.items()):
        path = tmp_path / f"k{i}"
        write(path, adapter)
        tensors = peft_tensors(adapter)
        tensors[key] = torch.zeros(4, 64)
        save_file(tensors, str(path / ADAPTER_WEIGHTS_NAME))
        with pytest.raises(ValueError, match=reason):
            load(path, config)


def test_base_model_mismatch_and_rank_limits(config, tiny_config, tmp_path):
    other = tiny_config("llama", hidden_size=96, num_attention_heads=4, num_key_value_heads=2)
    path = write(tmp_path / "other", small_adapter(other))
    with pytest.raises(ValueError, match="does not fit the base model: layer 0 q_proj"):
        load(path, config)
    deeper = tiny_config("llama", num_hidden_layers=3)
    path = write(tmp_path / "deeper", small_adapter(deeper))
    with pytest.raises(ValueError, match="weights for layer 2; the model has 2 layers"):
        load(path, config)
    path = write(tmp_path / "r16", small_adapter(config, rank=16))
    with pytest.raises(ValueError, match="rank 16 exceeds max_lora_rank 8"):
        load(path, config, max_rank=8)
    assert load(path, config, max_rank=16).rank == 16
    path = write(tmp_path / "lying", small_adapter(config, rank=4), r=8)
    with pytest.raises(ValueError, match="says r=8 but lora_A weights have rank"):
        load(path, config)
    adapter = small_adapter(config)
    path = tmp_path / "half"
    write(path, adapter)
    save_file(peft_tensors(adapter, halves="A"), str(path / ADAPTER_WEIGHTS_NAME))
    with pytest.raises(ValueError, match="has no lora_B weight"):
        load(path, config)


def test_allowed_adapter_dir(config, tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    inside = write(allowed / "a", small_adapter(config))
    outside = write(tmp_path / "outside", small_adapter(config))
    assert load(inside, config, allowed_dir=str(allowed)).rank == 4
    with pytest.raises(ValueError, match="outside the allowed adapter directory"):
        load(outside, config, allowed_dir=str(allowed))
    with pytest.raises(ValueError, match="outside the allowed adapter directory"):
        load(str(allowed / ".." / "outside"), config, allowed_dir=str(allowed))
    os.symlink(outside, allowed / "link")
    with pytest.raises(ValueError, match="outside the allowed adapter directory"):
        load(allowed / "link", config, allowed_dir=str(allowed))
    (tmp_path / "allowed-but-not").mkdir()  # a sibling sharing the prefix is still outside
    with pytest.raises(ValueError, match="outside"):
        resolve_adapter_dir(str(tmp_path / "allowed-but-not"), str(allowed))
    with pytest.raises(ValueError, match="outside"):  # refused before telling what exists
        resolve_adapter_dir(str(tmp_path / "nope"), str(allowed))


def test_create_is_peft_init_and_validates(config):
    adapter = LoRAAdapter.create(target_shapes(config), 2, 8, 16.0, ["q_proj", "down_proj"])
    assert adapter.target_modules == ("q_proj", "down_proj") and adapter.scaling == 2.0
    a, b = adapter.weights[(0, "q_proj")]
    assert b.abs().sum() == 0 and a.abs().max() <= 1 / config.hidden_size**0.5
    with pytest.raises(ValueError, match="unsupported LoRA target"):
        LoRAAdapter.create(target_shapes(config), 2, 8, 16.0, ["lm_head"])
    with pytest.raises(ValueError, match="rank"):
        LoRAAdapter(rank=4, lora_alpha=8, weights={(0, "q_proj"): (torch.zeros(2, 64),
                                                                     torch.zeros(64, 2))})

"""(IA)3 adapters: the PEFT format both ways through the `peft` library, forward equal to PEFT's
modules (output-scaled and feed-forward), FlexLLM's bypass form, and the errors for adapters that
do not fit."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from flexserve.peft.bypass import target_shapes
from flexserve.peft.ia3 import IA3Adapter
from flexserve.peft.lora import LoRAAdapter
from flexserve.peft.peft_io import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    load_peft_adapter,
    save_peft_adapter,
)

BOTH = ("LORA", "IA3")
TARGETS = ["k_proj", "v_proj", "down_proj"]  # PEFT's Llama default, down_proj feed-forward


@pytest.fixture(scope="module")
def config(tiny_config):
    return tiny_config("llama")


def base_model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture
def peft_model(config):
    """A tiny HF Llama with PEFT's default (IA)3 and seeded random vectors (not the init ones)."""
    from peft import IA3Config, get_peft_model

    model = get_peft_model(base_model(config), IA3Config(task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ia3_l" in name:
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=generator))
    return model.eval()


def peft_vectors(model) -> dict[tuple[int, str], torch.Tensor]:
    vectors = {}
    for name, param in model.named_parameters():
        if "ia3_l" in name:
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            vectors[(layer, parts[parts.index("ia3_l") - 1])] = param.detach().reshape(-1)
    return vectors


def load(path, config) -> IA3Adapter:
    return load_peft_adapter(str(path), target_shapes(config), config.num_hidden_layers,
                             peft_types=BOTH)


def test_round_trip_through_the_peft_library(peft_model, config, tmp_path):
    from peft import PeftModel

    assert peft_model.peft_config["default"].target_modules == set(TARGETS)  # PEFT's default
    peft_model.save_pretrained(tmp_path / "from_peft")
    adapter = load(tmp_path / "from_peft", config)
    assert isinstance(adapter, IA3Adapter) and adapter.kind == "ia3"
    assert adapter.target_modules == tuple(TARGETS)
    assert adapter.feedforward_modules == ("down_proj",)
    expected = peft_vectors(peft_model)
    assert adapter.weights.keys() == expected.keys() and len(expected) == 2 * 3
    for key, vector in expected.items():
        assert torch.equal(adapter.weights[key], vector)
    assert adapter.weights[(0, "down_proj")].shape == (config.intermediate_size,)  # [in]
    assert adapter.weights[(0, "k_proj")].shape == (32,)  # [out]: 2 KV heads x 16

    save_peft_adapter(adapter, str(tmp_path / "from_us"), base_model_name_or_path="tiny")
    again = load(tmp_path / "from_us", config)
    assert again.base_model_name_or_path == "tiny"
    for key, vector in adapter.weights.items():
        assert torch.equal(again.weights[key], vector)
    reloaded = PeftModel.from_pretrained(base_model(config), str(tmp_path / "from_us")).eval()
    assert reloaded.peft_config["default"].feedforward_modules == {"down_proj"}
    for key, vector in peft_vectors(reloaded).items():
        assert torch.equal(vector, expected[key])
    ids = torch.tensor([[1, 5, 9, 200, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, peft_model(ids).logits, rtol=0, atol=0)
        with reloaded.disable_adapter():  # and the vectors really change the model
            assert not torch.allclose(reloaded(ids).logits, peft_model(ids).logits, atol=1e-3)


def test_forward_equals_peft_modules(peft_model, config, tmp_path):
    peft_model.save_pretrained(tmp_path)
    adapter = load(tmp_path, config)
    layers = peft_model.base_model.model.model.layers
    x = torch.randn(5, config.hidden_size)
    m = torch.randn(5, config.intermediate_size)
    with torch.no_grad():
        for layer in range(config.num_hidden_layers):
            for target, module, inp in (("k_proj", layers[layer].self_attn.k_proj, x),
                                        ("v_proj", layers[layer].self_attn.v_proj, x),
                                        ("down_proj", layers[layer].mlp.down_proj, m)):
                base_layer = module.base_layer
                base = base_layer(inp)
                ours = adapter.forward(layer, target, inp, base, weight=base_layer.weight)
                torch.testing.assert_close(ours, module(inp), rtol=0, atol=0)
                # FlexLLM's bypass form around the scaled tensor T: T * l = T + f_A(T).
                if adapter.is_feedforward(target):
                    bypassed = F.linear(inp + adapter.delta(layer, target, inp), base_layer.weight)
                else:
                    bypassed = base + adapter.delta(layer, target, base)
                torch.testing.assert_close(bypassed, module(inp), rtol=1e-5, atol=1e-6)
        # Unattached linears pass the base output through.
        assert adapter.forward(0, "q_proj", x, x) is x
    with pytest.raises(ValueError, match="feed-forward .* pass the backbone linear's weight"):
        adapter.forward(0, "down_proj", m, m)


def test_create_is_peft_init(config):
    shapes = target_shapes(config)
    adapter = IA3Adapter.create(shapes, config.num_hidden_layers)
    assert adapter.target_modules == tuple(TARGETS)
    assert adapter.feedforward_modules == ("down_proj",)
    assert all(torch.equal(v, torch.ones_like(v)) for v in adapter.weights.values())
    assert adapter.weights[(1, "down_proj")].shape == (config.intermediate_size,)
    adapter.check_compatible(shapes, config.num_hidden_layers)
    x = torch.randn(3, config.hidden_size)
    assert torch.equal(adapter.forward(0, "k_proj", x, x[:, :32]), x[:, :32])  # identity at init
    assert adapter.num_bytes == 2 * (32 + 32 + 128) * 4
    out_only = IA3Adapter.create(shapes, 1, ["q_proj", "up_proj"], feedforward_modules=["up_proj"])
    assert out_only.weights[(0, "up_proj")].shape == (config.hidden_size,)  # up's input
    half = adapter.to(dtype=torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in half.weights.values())
    assert half.feedforward_modules == ("down_proj",)


def test_invalid_adapters(config):
    shapes = target_shapes(config)
    with pytest.raises(ValueError, match="unsupported .IA.3 target module.*lm_head"):
        IA3Adapter.create(shapes, 2, ["lm_head"])
    with pytest.raises(ValueError, match="feedforward_modules down_proj must be among"):
        IA3Adapter.create(shapes, 2, ["k_proj"], feedforward_modules=["down_proj"])
    with pytest.raises(ValueError, match="must be 1-D"):
        IA3Adapter(weights={(0, "k_proj"): torch.ones(32, 1)}, feedforward_modules=())
    with pytest.raises(ValueError, match="at least one module"):
        IA3Adapter(weights={}, feedforward_modules=())
    # An [in] vector for down_proj while the adapter says its output is scaled.
    wrong = IA3Adapter(weights={(0, "down_proj"): torch.ones(128)}, feedforward_modules=())
    with pytest.raises(ValueError, match="layer 0 down_proj has an .IA.3 vector of length 128; "
                                         "the model's down_proj scales its output, which has 64"):
        wrong.check_compatible(shapes, 2)
    deep = IA3Adapter(weights={(2, "k_proj"): torch.ones(32)}, feedforward_modules=())
    with pytest.raises(ValueError, match="weights for layer 2; the model has 2 layers"):
        deep.check_compatible(shapes, 2)


def write(tmp_path, name: str, adapter: IA3Adapter, **config_changes) -> str:
    path = tmp_path / name
    save_peft_adapter(adapter, str(path))
    if config_changes:
        config_path = path / ADAPTER_CONFIG_NAME
        data = json.loads(config_path.read_text())
        data.update(config_changes)
        config_path.write_text(json.dumps(data))
    return str(path)


def test_loader_dispatch_and_errors(config, tmp_path):
    shapes, layers = target_shapes(config), config.num_hidden_layers
    adapter = IA3Adapter.create(shapes, layers)
    path = write(tmp_path, "ia3", adapter)
    # The serving path asks for LoRA only and gets a clear refusal, not an IA3Adapter.
    with pytest.raises(ValueError, match="peft_type 'IA3' is not supported here; supported: LORA"):
        load_peft_adapter(path, shapes, layers)
    lora = LoRAAdapter.create(shapes, layers, 4, 8.0, ["q_proj"])
    lora_path = str(tmp_path / "lora")
    save_peft_adapter(lora, lora_path)
    assert isinstance(load_peft_adapter(lora_path, shapes, layers, peft_types=BOTH), LoRAAdapter)
    with pytest.raises(ValueError, match="unknown peft type"):
        load_peft_adapter(path, peft_types=("PREFIX_TUNING",))

    with pytest.raises(ValueError, match="says it is a feed-forward module, but its ia3_l is "
                                         "stored as .out, 1."):
        load(write(tmp_path, "ff", adapter, feedforward_modules=["down_proj", "k_proj"]), config)
    with pytest.raises(ValueError, match="modules_to_save"):
        load(write(tmp_path, "mts", adapter, modules_to_save=["lm_head"]), config)
    with pytest.raises(ValueError, match="unsupported .IA.3 target_modules lm_head"):
        load(write(tmp_path, "lm", adapter, target_modules=["k_proj", "lm_head"]), config)
    with pytest.raises(ValueError, match="feedforward_modules down_proj are not in target_modules"):
        load(write(tmp_path, "sub", adapter, target_modules=["k_proj", "v_proj"]), config)
    # A LoRA tensor in an (IA)3 adapter, a vector of the wrong rank, another model's widths.
    bad = write(tmp_path, "keys", adapter)
    save_file({"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": torch.ones(4, 64)},
              os.path.join(bad, ADAPTER_WEIGHTS_NAME))
    with pytest.raises(ValueError, match="unexpected tensor .*lora_A.weight. in an .IA.3 adapter"):
        load(bad, config)
    save_file({"base_model.model.model.layers.0.self_attn.k_proj.ia3_l": torch.ones(2, 32)},
              os.path.join(bad, ADAPTER_WEIGHTS_NAME))
    with pytest.raises(ValueError, match=r"ia3_l has shape \(2, 32\)"):
        load(bad, config)
    with pytest.raises(ValueError, match="does not fit the base model: layer 0 down_proj"):
        load(path, type(config)(**{**config.to_dict(), "intermediate_size": 96}))
    # A regex feedforward_modules: the stored shapes decide which modules are feed-forward.
    regex = load(write(tmp_path, "regex", adapter, feedforward_modules=".*down_proj"), config)
    assert regex.feedforward_modules == ("down_proj",)

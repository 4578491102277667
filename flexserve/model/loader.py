"""Builds the model on its device and fills it: safetensors by name, or seeded dummy weights."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tqdm import tqdm

from flexserve.config import ModelConfig
from flexserve.model.llama import LlamaForCausalLM
from flexserve.model.registry import ResolvedModel, no_weights_message

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DUMMY_WEIGHT_STD = 0.02  # HF's initializer_range for Llama-family models


def resolve_dtype(dtype: str, device: torch.device | str) -> torch.dtype:
    """The torch dtype: auto is float32 on CPU and bfloat16 on CUDA; otherwise the named one."""
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def load_model(
    model_config: ModelConfig, resolved: ResolvedModel, device: torch.device, dtype: torch.dtype
) -> LlamaForCausalLM:
    """The model of `resolved` on `device` in `dtype`, weights per `model_config.load_format`."""
    device = torch.device(device)
    if model_config.load_format == "auto" and resolved.path is None:
        raise ValueError(no_weights_message(resolved.name))
    # Parameters are allocated on the target device in the target dtype from the start: an 8B
    # model never exists as fp32 on the host.
    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(resolved.hf_config, model_config.max_model_len)
    if model_config.load_format == "dummy":
        init_dummy_weights(model, model_config.seed)
    else:
        model.load_weights(iter_safetensors(resolved.path, device, model.checkpoint_index,
                                            model.holds_weight))
    # The backbone is frozen: only bypass networks (LoRA) attached later ever train.
    return model.requires_grad_(False).eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int, std: float = DUMMY_WEIGHT_STD) -> None:
    """Deterministic random weights for `seed`, generated on the parameters' device.

    Linear/embedding weights and biases ~ N(0, std); norm weights = 1. The same seed gives the same
    weights on the same device type (CPU and CUDA generators differ).
    """
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's safetensors files: the index's shards, model.safetensors, or all of them."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [os.path.join(path, shard) for shard in sorted(set(weight_map.values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(
            f"no safetensors weights in {path!r} (only safetensors checkpoints are supported; "
            "use --load-format dummy for random weights)"
        )
    return files


IndexOf = Callable[[str, tuple[int, ...]], "tuple[slice, ...] | None"]


def iter_safetensors(path: str, device: torch.device, index_of: IndexOf | None = None,
                     wanted: Callable[[str], bool] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor, read straight onto `device` one at a time.

    `index_of(name, shape)`: the part of each tensor to read (a tensor-parallel rank's shard,
    read alone from the file, so no rank holds the whole model); None from it: all of it.
    `wanted(name)`: False skips the tensor unread (another pipeline stage's)."""
    from safetensors import safe_open

    files = safetensors_files(path)
    device = torch.device(device)
    target = _safe_open_device(device)
    for file in tqdm(files, desc="loading safetensors shards", unit="shard", disable=len(files) < 2):
        with safe_open(file, framework="pt", device=target) as f:
            for name in f.keys():
                if wanted is not None and not wanted(name):
                    continue
                if index_of is None:
                    yield name, f.get_tensor(name)
                    continue
                part = f.get_slice(name)
                index = index_of(name, tuple(part.get_shape()))
                if index is None:
                    yield name, f.get_tensor(name)
                else:
                    yield name, part[index].to(device)


def _safe_open_device(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    return device.type


def load_tokenizer(resolved: ResolvedModel, tokenizer: str | None = None) -> Any | None:
    """AutoTokenizer from `tokenizer` (a directory) or the model's own; None when it has none."""
    path = tokenizer or resolved.tokenizer_path
    if path is None:
        return None
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer directory {path!r} does not exist")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)

"""Builds the worker side of an engine: resolve the model, load it, size the KV cache."""

from __future__ import annotations

import logging
from typing import Any

import torch

from flexserve.config import EngineConfig
from flexserve.engine.model_info import ModelInfo
from flexserve.model.loader import load_tokenizer
from flexserve.model.registry import resolve_model
from flexserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    """The context length: the request, bounded by what the checkpoint's positions allow."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if requested is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings; set max_model_len")
        return int(limit)
    if limit is not None and requested > limit:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's max_position_embeddings {limit}"
        )
    return requested


def build_executor(config: EngineConfig) -> tuple[ModelRunner, Any | None, ModelInfo]:
    """Load everything the engine needs; raises ValueError for a bad model or configuration."""
    resolved = resolve_model(config.model.model, config.model.load_format)
    max_model_len = resolve_max_model_len(config.model.max_model_len, resolved.hf_config)
    tokenizer = load_tokenizer(resolved, config.model.tokenizer)
    runner = ModelRunner(config, resolved)
    num_blocks = runner.initialize_kv_cache(max_model_len)
    capacity = num_blocks * config.cache.block_size
    if capacity < max_model_len:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of "
            f"{config.cache.block_size}), fewer than max_model_len {max_model_len}: give the cache "
            "more memory or lower max_model_len"
        )
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(resolved.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
    runner.set_tokenizer(tokenizer, eos)
    info = ModelInfo(
        name=resolved.name,
        vocab_size=runner.vocab_size,
        max_model_len=max_model_len,
        eos_token_id=eos,
        num_blocks=num_blocks,
        block_size=config.cache.block_size,
        device=str(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."),
        num_layers=resolved.hf_config.num_hidden_layers,
        device_name=(torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda"
                     else "cpu"),
    )
    lora = runner.lora_manager
    if lora is not None:
        info.num_finetune_slots = lora.num_finetune_slots
        info.finetune_state_bytes = lora.finetune_state_bytes
        info.lora_target_features = dict(lora.shapes)
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB); max_model_len %d",
        num_blocks, config.cache.block_size, capacity,
        num_blocks * runner.kv_cache_spec.bytes_per_block / (1 << 30), max_model_len,
    )
    if config.finetune.warmup and runner.lora_manager is not None and runner.device.type == "cuda":
        from flexserve.worker.finetune.warmup import warmup_finetune

        warmup_finetune(runner, info, config)
    return runner, tokenizer, info

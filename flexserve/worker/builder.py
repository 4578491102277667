"""Builds the worker side of an engine: resolve the model, load it, size the KV cache."""

from __future__ import annotations

import logging
from typing import Any

import torch

from flexserve.config import EngineConfig
from flexserve.engine.model_info import ModelInfo
from flexserve.model.llama import check_supported
from flexserve.model.loader import load_tokenizer
from flexserve.model.registry import ResolvedModel, resolve_model
from flexserve.model.tp_layout import check_tensor_parallel
from flexserve.worker.distributed_executor import DistributedExecutor
from flexserve.worker.model_runner import ModelRunner
from flexserve.worker.mp_executor import MultiprocExecutor

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


def build_executor(
    config: EngineConfig,
) -> tuple[ModelRunner | DistributedExecutor, Any | None, ModelInfo]:
    """Load everything the engine needs; raises ValueError for a bad model or configuration.
    Under tensor parallelism the executor is a `MultiprocExecutor` over worker processes, or a
    `RayExecutor` over Ray actors (`distributed_executor_backend`)."""
    resolved = resolve_model(config.model.model, config.model.load_format)
    max_model_len = resolve_max_model_len(config.model.max_model_len, resolved.hf_config)
    tokenizer = load_tokenizer(resolved, config.model.tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(resolved.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
    if config.parallel.world_size > 1:
        return _build_distributed(config, resolved, max_model_len, tokenizer, eos)
    runner = ModelRunner(config, resolved)
    num_blocks = runner.initialize_kv_cache(max_model_len)
    _check_capacity(num_blocks, config.cache.block_size, max_model_len)
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
        num_blocks, config.cache.block_size, num_blocks * config.cache.block_size,
        num_blocks * runner.kv_cache_spec.bytes_per_block / (1 << 30), max_model_len,
    )
    if config.finetune.warmup and runner.lora_manager is not None and runner.device.type == "cuda":
        from flexserve.worker.finetune.warmup import warmup_finetune

        warmup_finetune(runner, info, config)
    return runner, tokenizer, info


def _build_distributed(config: EngineConfig, resolved: ResolvedModel, max_model_len: int,
                       tokenizer: Any | None, eos: int | None
                       ) -> tuple[DistributedExecutor, Any | None, ModelInfo]:
    world_size = config.parallel.world_size
    # Checked here, before any worker starts, for a start-up error that names the sizes.
    check_supported(resolved.hf_config, max_model_len)
    check_tensor_parallel(resolved.hf_config, config.parallel.tensor_parallel_size)
    num_layers, pp = resolved.hf_config.num_hidden_layers, config.parallel.pipeline_parallel_size
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} is more than the model's {num_layers} "
                         "layers: every stage holds at least one")
    if config.parallel.distributed_executor_backend == "ray":
        from flexserve.worker.ray_executor import RayExecutor

        executor: DistributedExecutor = RayExecutor(config, resolved, max_model_len, tokenizer,
                                                    eos)
    else:
        executor = MultiprocExecutor(config, resolved, max_model_len, tokenizer, eos)
    ready = executor.ready
    try:
        _check_capacity(ready.num_blocks, config.cache.block_size, max_model_len)
    except ValueError:
        executor.shutdown()
        raise
    info = ModelInfo(
        name=resolved.name,
        vocab_size=ready.vocab_size,
        max_model_len=max_model_len,
        eos_token_id=eos,
        num_blocks=ready.num_blocks,
        block_size=config.cache.block_size,
        device=ready.device,
        dtype=ready.dtype,
        num_layers=resolved.hf_config.num_hidden_layers,
        device_name=ready.device_name,
        num_finetune_slots=ready.num_finetune_slots,
        finetune_state_bytes=ready.finetune_state_bytes,
        lora_target_features=dict(ready.lora_target_features or {}),
    )
    logger.info(
        "tensor parallel over %d ranks (%s): KV cache %d blocks x %d tokens per rank "
        "(%.2f GiB each); max_model_len %d", world_size, config.parallel.distributed_executor_backend,
        ready.num_blocks, config.cache.block_size,
        ready.num_blocks * ready.bytes_per_block / (1 << 30), max_model_len,
    )
    return executor, tokenizer, info


def _check_capacity(num_blocks: int, block_size: int, max_model_len: int) -> None:
    capacity = num_blocks * block_size
    if capacity < max_model_len:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of "
            f"{block_size}), fewer than max_model_len {max_model_len}: give the cache "
            "more memory or lower max_model_len"
        )

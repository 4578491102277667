"""Sizing and allocation of the paged KV cache tensors."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from flexserve.config import CacheConfig

logger = logging.getLogger(__name__)

_GIB = 1 << 30


@dataclass(slots=True)
class KVCacheSpec:
    """Shape of the cache: one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer."""

    num_layers: int  # decoder layers, one cache tensor each
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int  # per-head width
    block_size: int  # tokens per block
    dtype: torch.dtype  # element type of K and V

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def num_blocks_for_bytes(self, num_bytes: float) -> int:
        return int(num_bytes // self.bytes_per_block)


def num_blocks_from_memory(
    spec: KVCacheSpec,
    cache_config: CacheConfig,
    device: torch.device,
    non_kv_peak_bytes: int = 0,
) -> int:
    """How many blocks the configured memory holds.

    On CUDA: `gpu_memory_utilization` of the device's total memory, minus what is in use now
    (weights, CUDA context, other processes) and the activation peak of a profiling forward that
    the caller measured (`non_kv_peak_bytes`). On CPU: `kv_cache_gib`.
    """
    if cache_config.num_blocks is not None:
        return cache_config.num_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * cache_config.gpu_memory_utilization - (total - free) - non_kv_peak_bytes
        num_blocks = spec.num_blocks_for_bytes(max(budget, 0))
        logger.info(
            "KV cache budget: %.2f GiB of %.2f GiB (utilization %.2f, in use %.2f GiB, "
            "activation peak %.2f GiB)",
            max(budget, 0) / _GIB, total / _GIB, cache_config.gpu_memory_utilization,
            (total - free) / _GIB, non_kv_peak_bytes / _GIB,
        )
    else:
        num_blocks = spec.num_blocks_for_bytes(cache_config.kv_cache_gib * _GIB)
    if num_blocks <= 0:
        raise ValueError(
            "no memory is left for the KV cache; raise --gpu-memory-utilization / --kv-cache-gib "
            "or lower --max-num-batched-tokens"
        )
    return num_blocks


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer (zeros so never-written slots cannot hold NaNs)."""
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

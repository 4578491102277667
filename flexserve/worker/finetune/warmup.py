"""Compile the kernels of eager iterations at start-up, before any request can wait on them.

Triton compiles a kernel the first time it meets a new signature (dtypes, rank, whether integer
arguments are multiples of 16), 0.5-1.3 s each on an H200. Served alone, that delays a job's
first windows; co-served, every request decoding in those iterations waits too: on a fresh
H200, the first 30 s co-serving run (4 req/s, a fine-tuning job starting with it) met the TPOT
SLO for 33% of requests against 95% once the kernels were compiled (docs/benchmarks.md).

`warmup_finetune` runs, through the profiler's plans (`flexserve.worker.profiler.profile_executor`)
on the idle executor:
- two short fine-tuning sequences (forward windows with decode rows riding along, the layer-wise
  backward of every layer, windows of 16-multiple and other sizes), with a LoRA job on all seven
  projections; the job, its slot's weights and its KV blocks are gone afterwards. The sequences
  run twice, without and with LoRA dropout (WARMUP_LORA_DROPOUT): whether a slot has dropout is a
  compile-time constant of the fused LoRA kernels and the mask kernel, and dropout is off by
  default, so a job that sets it would otherwise compile those variants in its first windows;
- prefill chunks of each query-tile size (16-128 tokens), alone and next to a decode row whose
  context spans 256-4096+ keys: every split count that decode attention picks for a mixed batch
  (a compile-time constant: 22 variants compiled during the first 30 s of a cold co-serving run).
Pure decode steps need none: CUDA-graph capture compiled them. Jobs of another rank may still
compile their own LoRA kernel variants.

Before those, `warmup_window_attention` builds cuDNN's attention plans for the whole-prefix
backward windows, one per bucket length up to the longest fine-tuning sequence's
(`backward_ops.window_attention`, FLEXSERVE_WINDOW_ATTENTION=cudnn-buckets): a plan built
mid-serving stalled an iteration by 110-190 ms on the H200 (docs/benchmarks.md).
torch keeps those plans per thread, so a thread other than the loading one that runs the
backward (the server's engine thread) has to call `warmup_window_attention` itself; until it
does, its windows run flash.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from flexserve import envs
from flexserve.worker.finetune.backward_ops import (
    cudnn_prefix_buckets,
    warm_prefix_attention,
)
from flexserve.worker.profile_grid import FinetuneScenario, InferenceCase, ProfileGrid
from flexserve.worker.profiler import profile_executor

logger = logging.getLogger(__name__)

# The second pass's dropout: any p > 0 compiles the kernels' dropout branch (p is a tensor argument).
WARMUP_LORA_DROPOUT = 0.1


def warmup_grid(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int,
                max_finetune_len: int, num_blocks: int, block_size: int) -> ProfileGrid | None:
    """The warm-up's sequences within the engine's limits; None when they do not fit (the
    first job then compiles its kernels itself)."""
    limit = min(max_num_batched_tokens, max_model_len, max_finetune_len)
    aligned, odd = min(256, limit // 16 * 16), min(300, limit)
    if aligned < 16 or odd < 16:
        return None
    rows = InferenceCase(decode_rows=min(2, max_num_seqs), decode_context=16)
    inference = [rows]
    for chunk in (16, 32, 64, 128):
        if chunk + 1 > min(max_num_batched_tokens, max_model_len):
            break
        inference.append(InferenceCase([(0, chunk)]))
        context = 256  # decode attention's keys per split (MIN_KEYS_PER_SPLIT): splits 1, 2, 4, ...
        while context <= max_model_len and max_num_seqs >= 2:
            inference.append(InferenceCase([(0, chunk)], 1, context))
            context *= 2
    scenarios = [
        # 16-multiple windows, several backward windows (layers) per iteration, decode rows.
        FinetuneScenario(aligned, max(16, aligned // 2), max(16, aligned // 2), backward_group=8,
                         inference=rows),
        # Windows that are not multiples of 16, one backward window per iteration.
        FinetuneScenario(odd, max(1, odd * 2 // 3), max(1, odd // 3)),
    ]
    blocks = sum(2 * -(-s.num_tokens // block_size) for s in scenarios)
    if blocks >= num_blocks:
        return None
    return ProfileGrid(inference=inference, finetune=scenarios, max_tokens=max_num_batched_tokens,
                       max_context=max_model_len, max_rows=max_num_seqs,
                       max_finetune_len=max_finetune_len, num_heldout_inference=0,
                       num_heldout_finetune=0)


def warmup_finetune(executor: Any, info: Any, config: Any) -> float | None:
    """Run the warm-up on `executor` (a `ModelRunner` with LoRA slots, nothing scheduled yet);
    returns its seconds, or None when the engine's limits leave no room for it."""
    max_finetune_len = config.finetune.max_finetune_len or info.max_model_len
    warmup_window_attention(executor, max_finetune_len)
    grid = warmup_grid(config.scheduler.max_num_batched_tokens, info.max_model_len,
                       config.scheduler.max_num_seqs, max_finetune_len, info.num_blocks,
                       info.block_size)
    if grid is None:
        logger.info("fine-tuning warm-up skipped: the engine's limits leave no room for it")
        return None
    start = time.perf_counter()
    iterations = profile_executor(executor, info, grid, repeats=1, warmup=0, progress=False).num_iterations
    # The fine-tuning sequences again with dropout (the inference cases have nothing new to compile).
    iterations += profile_executor(executor, info, dataclasses.replace(grid, inference=[]), repeats=1, warmup=0,
                                   progress=False, lora_dropout=WARMUP_LORA_DROPOUT).num_iterations
    seconds = time.perf_counter() - start
    logger.info("fine-tuning kernels warmed up in %.1f s (%d iterations)", seconds, iterations)
    return seconds


def warmup_window_attention(executor: Any, max_finetune_len: int) -> list[int] | None:
    """Build, in the calling thread, cuDNN's plans of the whole-prefix backward windows for
    `executor`'s model (head counts, head dim, scale, dtype), one per bucket length that runs on
    cuDNN up to `max_finetune_len`'s (`cudnn_prefix_buckets`); returns the lengths built, or
    None where windows do not use them (not CUDA, FLEXSERVE_WINDOW_ATTENTION=flash)."""
    if executor.device.type != "cuda" or envs.window_attention() != "cudnn-buckets":
        return None
    attn = executor.model.model.layers[0].self_attn.attn
    lengths = cudnn_prefix_buckets(max_finetune_len)
    if not lengths:
        return []
    start = time.perf_counter()
    built = warm_prefix_attention(lengths, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                  executor.dtype, executor.device, attn.scale)
    torch.cuda.synchronize(executor.device)
    seconds = time.perf_counter() - start
    torch.cuda.empty_cache()  # the largest buckets' buffers
    if built:
        executor.warm_prefix_len = max_finetune_len  # for `prepare_thread` of other threads
        logger.info("cuDNN window attention: plans for %d bucket lengths (%d-%d rows) built in "
                    "%.1f s", len(built), built[0], built[-1], seconds)
    if len(built) < len(lengths):
        logger.warning("cuDNN window attention: no plans from the %d-row bucket up (cuDNN "
                       "refused it or memory ran out); those windows run flash",
                       lengths[len(built)])
    return built

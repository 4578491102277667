"""One tensor-parallel rank in its own process: it joins the group, builds its `ModelRunner`
over its shard of the model and of the KV cache, then runs every plan the engine sends, in
order, until told to stop (`MultiprocExecutor` drives it)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from flexserve.config import EngineConfig
from flexserve.distributed.parallel_state import destroy_tensor_parallel, init_model_parallel
from flexserve.engine.plan import BatchPlan, StepResult
from flexserve.model.loader import load_tokenizer
from flexserve.model.registry import ResolvedModel
from flexserve.worker.model_runner import ModelRunner, resolve_device
from flexserve.worker.plan_wire import PromptCache

logger = logging.getLogger(__name__)

POLL_S = 0.0001  # how often a rank waiting on its device looks for the engine's next plan


@dataclass(slots=True)
class WorkerReady:
    """A rank's report once its model and KV cache are up."""

    num_blocks: int  # KV cache blocks (the same on every rank)
    vocab_size: int  # rows of the gathered logits
    device: str  # the rank's device, e.g. cpu or cuda:1
    device_name: str  # the GPU's name, or cpu
    dtype: str  # weights' dtype without the torch. prefix
    bytes_per_block: int  # this rank's K and V bytes of one block across all layers
    num_finetune_slots: int = 0  # LoRA slots for fine-tuning jobs (the same on every rank)
    finetune_state_bytes: int = 0  # memory for the jobs' training state, per rank
    # (in, out) features of every LoRA target of the whole model (None: LoRA is off)
    lora_target_features: dict[str, tuple[int, int]] | None = None


@dataclass(slots=True)
class RankCall:
    """A call of a `ModelRunner` method that every rank makes, in order with the plans (the
    fine-tuning job calls: `RANK_METHODS`)."""

    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(slots=True)
class RankCallError:
    """A `RankCall` that raised ValueError (bad input, which every rank refuses alike): the
    executor raises it in the engine and stays up."""

    message: str


# The runner methods a `RankCall` may name: the fine-tuning jobs' life cycle and saves, which
# every rank runs (saves gather the adapter; rank 0 writes it).
RANK_METHODS = ("add_finetune_job", "end_finetune_job", "remove_finetune_job",
                "save_finetune_adapter", "save_finetune_checkpoint")


def check_rank_method(method: str) -> None:
    """ValueError unless `method` is one of `RANK_METHODS`."""
    if method not in RANK_METHODS:
        raise ValueError(f"{method!r} is not a rank call (one of {', '.join(RANK_METHODS)})")


def call_runner(runner: ModelRunner, call: RankCall) -> Any:
    """Run `call` on this rank's runner: its return value, or `RankCallError` for a ValueError."""
    try:
        check_rank_method(call.method)
        return getattr(runner, call.method)(*call.args, **call.kwargs)
    except ValueError as e:
        return RankCallError(str(e))


def run_message(runner: ModelRunner, message: Any, driver: bool) -> Any:
    """Run a plan (its `StepResult`) or a `RankCall` (its value, or `RankCallError`); the
    reply a rank sends back: the result on the driver rank, a `RankCallError` on any rank,
    None otherwise."""
    result = call_runner(runner, message) if isinstance(message, RankCall) else \
        runner.execute(message)
    return _sent_back(result, driver)


def _sent_back(result: Any, driver: bool) -> Any:
    """What a rank replies for a message's result: the result on the driver rank, a
    `RankCallError` on any rank, None otherwise."""
    return result if driver or isinstance(result, RankCallError) else None


def rank_reply(replies: list[Any], driver: int = 0) -> Any:
    """What the engine gets from all ranks' replies: the first `RankCallError`, else the
    driver's (`ParallelConfig.driver_rank`: the rank that samples)."""
    return next((r for r in replies if isinstance(r, RankCallError)), replies[driver])


@dataclass(slots=True)
class WorkerError:
    """A rank's failure: the formatted traceback of what it raised."""

    rank: int  # the rank that failed
    message: str  # its traceback


def run_worker(rank: int, world_size: int, init_method: str, config: EngineConfig,
               resolved: ResolvedModel, max_model_len: int, eos_token_id: int | None,
               conn: Connection) -> None:
    """The worker process's main: replies `WorkerReady` (or `WorkerError`) once, then for every
    `BatchPlan` received the `StepResult` (the driver rank, `ParallelConfig.driver_rank`) or None
    (other ranks), a `WorkerError` when the plan raised, and for every `RankCall` its value (the
    driver) or `RankCallError`; stops at
    None or when the engine's end of the pipe closes."""
    # Ctrl-C reaches the whole process group: the engine process decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        runner = start_rank(rank, world_size, init_method, config, resolved, max_model_len,
                            eos_token_id)
        conn.send(worker_ready(runner))
        prompts = PromptCache()  # the plans' prompts (`plan_wire`)
    except Exception:
        conn.send(WorkerError(rank, traceback.format_exc()))
        destroy_tensor_parallel()
        return
    try:
        serve_messages(runner, conn, prompts, rank, rank == config.parallel.driver_rank)
    finally:
        destroy_tensor_parallel()


def serve_messages(runner: ModelRunner, conn: Connection, prompts: PromptCache, rank: int,
                   driver: bool) -> None:
    """Run every message the engine sends, in order, one reply each, until None or the pipe
    closes. On CUDA a plan's reply waits for the device, and meanwhile the engine may already
    have sent the next plan (asynchronous scheduling sends a continuation before it waits): that
    plan is launched first and the earlier reply sent after, so this rank prepares step N+1
    while its device runs step N, as one process does."""
    overlap = runner.device.type == "cuda"
    pending: Callable[[], StepResult] | None = None  # a launched plan whose reply is owed
    done = torch.cuda.Event() if overlap else None  # recorded after `pending`'s launch

    def reply_of(wait: Callable[[], Any]) -> Any:
        try:
            result = wait()
        except Exception:
            return WorkerError(rank, traceback.format_exc())
        return _sent_back(result, driver)

    def send_pending() -> None:
        nonlocal pending
        if pending is not None:
            conn.send(reply_of(pending))
            pending = None

    while True:
        if pending is not None and not _next_message_first(conn, done):
            send_pending()
        try:
            message = prompts.decode(conn.recv_bytes())
        except EOFError:  # the engine process is gone
            message = None
        if message is None:
            try:
                send_pending()
            except OSError:  # the engine process is gone: nobody waits for it
                pass
            return
        if not (overlap and isinstance(message, BatchPlan) and message.continues_previous):
            send_pending()  # anything but a continuation follows its result
        if isinstance(message, RankCall):
            conn.send(reply_of(lambda message=message: call_runner(runner, message)))
            continue
        try:
            wait = runner.execute_async(message)
        except Exception:
            send_pending()
            conn.send(WorkerError(rank, traceback.format_exc()))
            continue
        send_pending()  # step N's, after step N+1 is launched
        if overlap:
            pending = wait
            done.record()
        else:
            conn.send(reply_of(wait))


def _next_message_first(conn: Connection, done: torch.cuda.Event | None) -> bool:
    """Whether the engine's next message arrives before the device finishes the launched plan
    (`done`): then the rank launches it first."""
    while True:
        if conn.poll(POLL_S):
            return True
        if done is None or done.query():
            return False


def worker_ready(runner: ModelRunner) -> WorkerReady:
    """The report of a rank whose runner is up."""
    lora = runner.lora_manager
    return WorkerReady(
        num_finetune_slots=0 if lora is None else lora.num_finetune_slots,
        finetune_state_bytes=0 if lora is None else lora.finetune_state_bytes,
        lora_target_features=None if lora is None else dict(lora.shapes),
        num_blocks=runner.num_blocks, vocab_size=runner.vocab_size,
        device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
        device_name=(torch.cuda.get_device_name(runner.device)
                     if runner.device.type == "cuda" else "cpu"),
        bytes_per_block=runner.kv_cache_spec.bytes_per_block)


def start_rank(rank: int, world_size: int, init_method: str, config: EngineConfig,
               resolved: ResolvedModel, max_model_len: int, eos_token_id: int | None,
               local_device: int | None = None) -> ModelRunner:
    """Join the group and build this rank's runner on GPU `local_device` of this process (the
    rank's index among the host's GPUs unless given: a Ray actor sees only its own GPU, 0)."""
    device = resolve_device(config.model.device)
    if device.type == "cuda":
        index = rank if local_device is None else local_device
        torch.cuda.set_device(index)
        config.model.device = f"cuda:{index}"  # this process's copy of the config
        backend = "nccl"
    else:
        # The ranks share the host's cores: each takes its part instead of all of them.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
        backend = "gloo"
    init_model_parallel(rank, config.parallel.tensor_parallel_size,
                        config.parallel.pipeline_parallel_size, init_method, backend,
                        custom_all_reduce=not config.parallel.disable_custom_all_reduce)
    runner = ModelRunner(config, resolved)
    runner.initialize_kv_cache(max_model_len)
    # Structured outputs compile their grammars against the tokenizer on every rank, so every
    # rank masks and samples the same tokens.
    runner.set_tokenizer(load_tokenizer(resolved, config.model.tokenizer), eos_token_id)
    logger.info("rank %d of %d ready: %d KV blocks", rank, world_size,
                runner.num_blocks)
    # The start-up's objects leave the cyclic collector's reach: a full collection walking them
    # would stall this rank, and every rank waits for it in the next collective
    # (`engine_builder.freeze_startup_objects` does the same in the engine process).
    gc.collect()
    gc.freeze()
    return runner


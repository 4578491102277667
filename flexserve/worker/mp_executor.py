"""The `mp` executor: the ranks (tensor-parallel, of every pipeline stage) as worker processes on
this host.

Every rank is a spawned process (`tp_worker.run_worker`) with its shard of the model, joined
over torch.distributed (gloo on CPU, NCCL on CUDA). Each plan goes to every rank through its
pipe (`plan_wire`); the driver rank's `StepResult` is the step's (`ParallelConfig.driver_rank`:
the last stage's first rank, rank 0 without pipeline stages). The engine process holds no model: it watches the
pipes and the processes together, so a rank that dies makes the step raise at once instead of
leaving the engine waiting on a collective that never completes.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from flexserve.config import EngineConfig
from flexserve.distributed.parallel_state import free_port
from flexserve.engine.plan import BatchPlan
from flexserve.model.registry import ResolvedModel
from flexserve.worker.distributed_executor import DistributedExecutor, WorkerDiedError
from flexserve.worker.plan_wire import PlanSender
from flexserve.worker.tp_worker import RankCall, WorkerError, WorkerReady, rank_reply, run_worker

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0  # how long ranks get to leave before they are terminated


class MultiprocExecutor(DistributedExecutor):
    """Drives one worker process per rank (every pipeline stage's tensor-parallel ranks) as one
    executor (`engine.executor`)."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel, max_model_len: int,
                 tokenizer: Any | None, eos_token_id: int | None) -> None:
        super().__init__(config, resolved, tokenizer, eos_token_id)
        world_size = config.parallel.world_size
        self._driver = config.parallel.driver_rank
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked into workers
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._processes: list[BaseProcess] = []
        self._conns: list[Connection] = []
        for rank in range(world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=run_worker, name=f"flexserve-tp{rank}", daemon=True,
                args=(rank, world_size, init_method, config, resolved, max_model_len,
                      eos_token_id, child))
            process.start()
            child.close()
            self._processes.append(process)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop_workers, self._processes, self._conns)
        self._error: WorkerDiedError | None = None
        self._sender = PlanSender()
        self._num_sent = 0  # plans sent to the ranks
        self._num_received = 0  # plans every rank has answered
        # Replies received and not taken yet, by message; messages whose waiter was dropped
        # unanswered (a plan launched ahead whose tokens nobody reads), whose replies go
        self._results: dict[int, Any] = {}
        self._abandoned: set[int] = set()
        try:
            self.ready: WorkerReady = self._receive_all()[0]
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d tensor-parallel workers ready (%s)", world_size,
                    ", ".join(f"rank {r}: pid {p.pid}" for r, p in enumerate(self._processes)))

    @property
    def processes(self) -> tuple[BaseProcess, ...]:
        """The ranks' worker processes, in rank order."""
        return tuple(self._processes)

    def shutdown(self) -> None:
        """Stop the ranks (terminating those that do not leave in time); idempotent."""
        self._finalizer()

    def _submit(self, message: BatchPlan | RankCall) -> Callable[[], Any]:
        self._check_alive()
        index = self._num_sent
        payload = self._sender.encode(message)  # once for every rank
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError:  # its end of the pipe closed: the process is exiting or gone
                self._fail(self._exit_reason(rank))
        self._num_sent += 1
        return _Reply(self, index)

    # ---------------------------------------------------------------------------------- internals
    def _result_of(self, index: int) -> Any:
        """The reply to message `index`, receiving the replies before it first. Replies may be
        waited for in any order: a rank call between a plan launched ahead and its wait takes
        its own reply and leaves the plan's for it."""
        while self._num_received <= index:
            self._check_alive()
            reply = rank_reply(self._receive_all(), self._driver)
            if self._num_received in self._abandoned:
                self._abandoned.discard(self._num_received)
            else:
                self._results[self._num_received] = reply
            self._num_received += 1
        return self._results.pop(index)

    def _abandon(self, index: int) -> None:
        """Message `index`'s waiter went without waiting: its reply is dropped."""
        if index < self._num_received:
            self._results.pop(index, None)
        else:
            self._abandoned.add(index)

    def _receive_all(self) -> list[Any]:
        """One reply from every rank, in rank order; raises `WorkerDiedError` when a rank died
        or any replied with an error."""
        replies: list[Any] = [None] * len(self._conns)
        pending = dict(enumerate(self._conns))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._processes)}
        while pending:
            ready = wait([*pending.values(), *sentinels])
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        replies[rank] = conn.recv()
                    except EOFError:
                        self._fail(self._exit_reason(rank))
                    del pending[rank]
            for sentinel in ready:
                rank = sentinels.get(sentinel)
                if rank is not None:
                    self._fail(self._exit_reason(rank))
        errors = [r for r in replies if isinstance(r, WorkerError)]
        if errors:
            self._fail(f"tensor-parallel rank {errors[0].rank} failed:\n{errors[0].message}")
        return replies

    def _exit_reason(self, rank: int) -> str:
        process = self._processes[rank]
        process.join(SHUTDOWN_TIMEOUT_S)
        return (f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                f"{process.exitcode}")

    def _check_alive(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, reason: str) -> None:
        """Stop every rank (the others would wait on the failed one forever) and raise."""
        self._error = WorkerDiedError(reason)
        logger.error("%s; stopping the tensor-parallel workers", reason)
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        self.shutdown()
        raise self._error


class _Reply:
    """Waits for one message's reply (`MultiprocExecutor._result_of`), once; dropped without
    waiting, it lets the executor drop the reply."""

    __slots__ = ("_executor", "_index", "_waited")

    def __init__(self, executor: MultiprocExecutor, index: int) -> None:
        self._executor, self._index, self._waited = executor, index, False

    def __call__(self) -> Any:
        if self._waited:
            raise RuntimeError(f"the reply to message {self._index} was taken already")
        self._waited = True
        return self._executor._result_of(self._index)

    def __del__(self) -> None:
        if not self._waited:
            self._executor._abandon(self._index)


def _stop_workers(processes: list[BaseProcess], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send(None)
        except OSError:
            pass  # that rank is gone already
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(SHUTDOWN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()


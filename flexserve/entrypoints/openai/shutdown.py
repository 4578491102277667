"""Graceful shutdown: SIGTERM drains the server instead of dropping what it is doing.

On the first SIGTERM (or SIGINT) the server
1. stops admitting: every new request except `/health`, `/metrics`, `/version` and
   `/openapi.json` gets 503 `server_shutting_down` (the listening socket stays open, so clients
   get an answer instead of a refused connection, and `/health` says "degraded: shutting down");
2. lets the requests in flight finish, for at most `--shutdown-grace-s`, while running
   fine-tuning jobs checkpoint at their next optimizer-step boundary (their store records stay
   `running`, so the next start resumes them from that checkpoint);
3. when the grace period is over, stops the engine: requests still running end with a 503
   `engine_dead` ("the server shut down before the request finished"), in-band for streams;
4. closes the listener and exits with status 0.
A second signal skips what is left of the drain; a third (or a second SIGINT) exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

from flexserve.engine.async_engine import AsyncLLMEngine
from flexserve.entrypoints.openai.limits import AdmissionController

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_GRACE_S = 30.0
_FLUSH_S = 5.0  # after the engine stopped: time for the last error responses to go out
SHUTDOWN_REASON = "the server shut down before the request finished (--shutdown-grace-s)"


class GracefulShutdown:
    """Drains one app: admission, in-flight requests, fine-tuning jobs, then the engine."""

    def __init__(self, admission: AdmissionController, engine: AsyncLLMEngine,
                 finetune: Any | None = None, grace_s: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
        if grace_s < 0:
            raise ValueError(f"the shutdown grace period must be >= 0 s, got {grace_s}")
        self.admission = admission
        self.engine = engine
        self.finetune = finetune  # the app's FinetuneService, or None
        self.grace_s = grace_s
        self.started = False
        self.done = asyncio.Event()

    async def drain(self) -> None:
        """Run the drain (once; a second call waits for the first)."""
        if self.started:
            await self.done.wait()
            return
        self.started = True
        try:
            await self._drain()
        finally:
            self.done.set()

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.grace_s
        admission = self.admission
        admission.begin_draining()
        logger.info("shutting down: %d requests in flight get up to %g s to finish; new "
                    "requests get 503", admission.num_in_flight, self.grace_s)
        jobs = None
        if self.finetune is not None:
            jobs = asyncio.ensure_future(self.finetune.checkpoint_running_jobs(self.grace_s))
        drained = await admission.wait_idle(deadline - time.monotonic())
        if jobs is not None:
            try:
                saved = await asyncio.wait_for(
                    asyncio.shield(jobs), max(deadline - time.monotonic(), 0.0))
                if saved:
                    logger.info("fine-tuning jobs checkpointed for the restart: %s",
                                ", ".join(saved))
            except asyncio.TimeoutError:
                logger.warning("fine-tuning jobs did not reach a step boundary within %g s: "
                               "they resume from their last periodic checkpoint", self.grace_s)
            except Exception:  # the drain goes on: the jobs resume from an older checkpoint
                logger.exception("checkpointing fine-tuning jobs at shutdown failed")
        if not drained:
            logger.warning("%d requests still in flight after %g s: aborting them",
                           admission.num_in_flight, self.grace_s)
        # Stopping the engine fails whatever still runs with EngineDeadError (a 503, or an
        # in-band error for streams) and frees its KV blocks; jobs stay `running` in the store.
        await asyncio.to_thread(self.engine.shutdown, 30.0, SHUTDOWN_REASON)
        if jobs is not None and not jobs.done():
            jobs.cancel()
        if not drained:
            await admission.wait_idle(_FLUSH_S)
        logger.info("drained; stopping the server")


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT start a `GracefulShutdown` and the process exits 0.

    uvicorn alone would stop listening at once and re-raise the signal after shutting down, so
    the process would die by SIGTERM (status 143) instead of exiting cleanly.
    """

    def __init__(self, config: uvicorn.Config, shutdown: GracefulShutdown) -> None:
        super().__init__(config)
        self.graceful = shutdown
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._num_signals = 0

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # The signal is deliberately not recorded (`_captured_signals`): uvicorn would re-raise
        # it after shutting down and the process would not exit 0.
        self._num_signals += 1
        if self._num_signals == 1 and self.started and self._loop is not None:
            logger.info("received %s: draining", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(self._start_drain)
        elif self._num_signals <= 2 and not (self._num_signals == 2 and sig == signal.SIGINT):
            self.should_exit = True  # skip the rest of the drain (or none started yet)
        else:
            self.should_exit = self.force_exit = True

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.graceful.drain()
        finally:
            self.should_exit = True

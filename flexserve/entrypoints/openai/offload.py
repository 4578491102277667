"""Per-request CPU work off the event loop: a few worker threads behind a bounded queue.

Tokenizing a long prompt, rendering a chat template, parsing a large JSON body or a training file
can take seconds; on the event loop that would stall every other request, `/health` included.
Handlers run such work through `Offload.run`: at most `num_workers` pieces run at once (the
tokenizer releases the GIL; Python code is preempted every few milliseconds), and at most
`max_pending` wait or run. Past that the server is busy: 429 with Retry-After, never an unbounded
queue.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from flexserve.entrypoints.openai.errors import APIError

T = TypeVar("T")
DEFAULT_NUM_WORKERS = 2
DEFAULT_MAX_PENDING = 64


class ServerBusyError(APIError):
    """The offload queue is full: a 429 the client may retry."""

    def __init__(self, max_pending: int) -> None:
        super().__init__(429, f"The server is busy preparing {max_pending} other requests; retry "
                              "after the Retry-After delay.", "rate_limit_error",
                         code="server_busy", headers={"Retry-After": "1"})


class Offload:
    """A bounded pool of worker threads for per-request CPU work (module docstring)."""

    def __init__(self, num_workers: int = DEFAULT_NUM_WORKERS,
                 max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if num_workers < 1 or max_pending < num_workers:
            raise ValueError(f"need 1 <= num_workers <= max_pending, got {num_workers} and "
                             f"{max_pending}")
        self.max_pending = max_pending
        self.num_pending = 0  # pieces of work queued or running (event-loop only)
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="flexserve-offload")

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on a worker thread; ServerBusyError (429) when the queue is
        full. Exceptions of `fn` propagate."""
        if self.num_pending >= self.max_pending:
            raise ServerBusyError(self.max_pending)
        self.num_pending += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor,
                                              functools.partial(fn, *args, **kwargs))
        finally:
            self.num_pending -= 1

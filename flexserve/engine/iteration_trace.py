"""Iteration traces: where a served workload and the latency model part, one line at a time.

`FLEXSERVE_ITERATION_TRACE=path` makes the engine append JSON lines to `path` (line-buffered):

- one per executed iteration: its `IterationShape` counts, the prediction the window sizing
  used (`predicted`, corrected), the measured `seconds` of schedule + execute, the engine
  thread's CPU time in them (`thread_seconds`: far below `seconds` means the thread waited, for
  the device, the GIL or a lock), the online corrections (`scale`, `backward_scale`) and the
  step `mode`;
- `{"event": "triton_compile", "kernel", "seconds", "key"}` for every Triton kernel variant compiled
  while the engine runs (a variant the start-up warm-up missed stalls its iteration 0.5-1.5 s
  on an H200);
- `{"event": "stall", "seconds", "stacks"}` once per engine step that is still running after
  `FLEXSERVE_STALL_DUMP_S` (default 1.0) seconds in the server: every thread's Python stack.

`load_trace` reads the iteration lines back (as latency-model samples). Diagnostics only: with
the variable unset nothing is installed and nothing is written.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from flexserve import envs
from flexserve.engine.iteration_shape import SHAPE_FIELDS, IterationShape


class IterationTrace:
    """The open trace file; thread-safe (the stall watchdog writes from its own thread)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - held for the process
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> IterationTrace | None:
        path = envs.iteration_trace()
        if not path:
            return None
        trace = cls(path)
        trace.watch_triton_compiles()
        return trace

    def _write(self, line: dict) -> None:
        text = json.dumps(line) + "\n"
        with self._lock:
            self._file.write(text)

    def record(self, shape: IterationShape, predicted: float, seconds: float, scale: float,
               mode: str | None, thread_seconds: float | None = None,
               backward_scale: float = 1.0) -> None:
        line: dict[str, Any] = {name: getattr(shape, name) for name in SHAPE_FIELDS}
        line.update(predicted=predicted, seconds=seconds, scale=scale,
                    backward_scale=backward_scale, mode=mode, thread_seconds=thread_seconds,
                    time=time.time())
        self._write(line)

    def event(self, kind: str, **fields: Any) -> None:
        self._write({"event": kind, "time": time.time(), **fields})

    def watch_triton_compiles(self) -> None:
        """Record every Triton compile of this process (wraps `JITFunction._do_compile`, where
        triton 3.6-3.9 compiles a variant; nothing happens where it is missing)."""
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        compile_fn = getattr(JITFunction, "_do_compile", None)
        if compile_fn is None or getattr(compile_fn, "_flexserve_traced", False):
            return
        trace = self

        def traced(jit_fn, *args, **kwargs):
            began = time.perf_counter()
            try:
                return compile_fn(jit_fn, *args, **kwargs)
            finally:
                trace.event("triton_compile", kernel=getattr(jit_fn, "__name__", str(jit_fn)),
                            seconds=time.perf_counter() - began,
                            key=str(args[0])[:2000] if args else None)

        traced._flexserve_traced = True
        JITFunction._do_compile = traced

    def start_stall_watchdog(self, step_started: Callable[[], float | None]) -> None:
        """A daemon thread that dumps every thread's stack once per step running longer than
        FLEXSERVE_STALL_DUMP_S; `step_started()` is the running step's time.monotonic() start,
        or None between steps."""
        threshold = envs.stall_dump_s()

        def watch() -> None:
            dumped = None
            while True:
                time.sleep(min(0.1, threshold / 4))
                started = step_started()
                if started is None or started == dumped:
                    continue
                running = time.monotonic() - started
                if running >= threshold:
                    dumped = started
                    names = {t.ident: t.name for t in threading.enumerate()}
                    stacks = {names.get(ident, str(ident)): "".join(traceback.format_stack(frame))
                              for ident, frame in sys._current_frames().items()}
                    self.event("stall", seconds=running, stacks=stacks)

        threading.Thread(target=watch, name="flexserve-stall-watchdog", daemon=True).start()


def load_trace(path: str) -> list[dict]:
    """The iteration lines of a trace (event lines skipped); each has `shape` (an
    IterationShape) added. ValueError naming the line for one that is neither."""
    records = []
    with open(path) as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
                if "event" in record:
                    continue
                record["shape"] = IterationShape(**{n: int(record[n]) for n in SHAPE_FIELDS})
                float(record["seconds"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: not an iteration trace record: {e}") from e
            records.append(record)
    return records

"""Per-forward attention metadata, reachable from every layer without threading it through calls.

The model runner wraps one forward in `set_forward_context(metadata)`; `Attention` layers read it
with `get_forward_context()`. The previous value is restored on exit, so nested forwards (a
profiling run inside a step, a backward window inside a co-serving step) cannot leak metadata.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

# A ContextVar instead of a bare global: each thread / asyncio task sees its own value.
_forward_context: ContextVar[Any | None] = ContextVar("flexserve_forward_context", default=None)


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[None]:
    """Make `attn_metadata` the current forward's metadata until the block exits."""
    token = _forward_context.set(attn_metadata)
    try:
        yield
    finally:
        _forward_context.reset(token)


def get_forward_context() -> Any:
    """The metadata of the forward in progress; RuntimeError outside `set_forward_context`."""
    attn_metadata = _forward_context.get()
    if attn_metadata is None:
        raise RuntimeError(
            "no forward context is set: run the model inside set_forward_context(metadata)"
        )
    return attn_metadata

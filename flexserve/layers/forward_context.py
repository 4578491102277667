"""Per-forward metadata, reachable from every layer without threading it through calls.

The model runner wraps one forward in `set_forward_context(attn_metadata, lora_meta, finetune)`;
`Attention` layers read `get_forward_context().attn_metadata`, LoRA linears `.lora_meta`, and the
decoder layers and LoRA linears hand fine-tuning rows' activations to `.finetune` when it is set.
All are built once per step and shared by every layer. The previous value is restored on exit, so
nested forwards (a profiling run inside a step, a backward window inside a co-serving step) cannot
leak metadata.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """What one forward's layers read."""

    attn_metadata: Any  # AttentionMetadata of the step's flat batch
    lora_meta: Any = None  # LoRAKernelMeta (each token's adapter slot); None: no token has one
    finetune: Any = None  # FinetuneCapture of the step's fine-tuning windows; None: none to capture


# A ContextVar instead of a bare global: each thread / asyncio task sees its own value.
_forward_context: ContextVar[ForwardContext | None] = ContextVar(
    "flexserve_forward_context", default=None)


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: Any, lora_meta: Any = None, finetune: Any = None
) -> Iterator[ForwardContext]:
    """Make this forward's metadata current until the block exits."""
    context = ForwardContext(attn_metadata, lora_meta, finetune)
    token = _forward_context.set(context)
    try:
        yield context
    finally:
        _forward_context.reset(token)


def get_forward_context() -> ForwardContext:
    """The context of the forward in progress; RuntimeError outside `set_forward_context`."""
    context = _forward_context.get()
    if context is None:
        raise RuntimeError(
            "no forward context is set: run the model inside set_forward_context(metadata)"
        )
    return context

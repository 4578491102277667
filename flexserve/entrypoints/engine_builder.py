"""Where the worker meets the engine: build the worker's executor and hand it to the engine.

The engine imports no worker (it sees the executor only through `flexserve.engine.executor`), so
the callers that own both sides (the offline `LLM`, the CLI and the server) build it here.
"""

from __future__ import annotations

import gc
from typing import Any

from flexserve.config import EngineConfig
from flexserve.engine.async_engine import AsyncLLMEngine
from flexserve.engine.llm_engine import LLMEngine
from flexserve.worker.builder import build_executor


def build_engine(config: EngineConfig) -> LLMEngine:
    """Resolve and load the model, size the KV cache, build the engine over its model runner."""
    executor, tokenizer, info = build_executor(config)
    return LLMEngine(config, executor, tokenizer, info)


def freeze_startup_objects() -> None:
    """Move every object alive now (the model's modules, the tokenizer, imported libraries:
    hundreds of thousands) out of the cyclic garbage collector's reach, as vLLM does after its
    start-up: a full collection otherwise walks them all, 0.3 s on the development CPU, and
    stalls every request decoding at that moment. Objects made later are collected as usual;
    frozen ones never are, so only a process that keeps its engine to the end calls this (the
    server; not `LLM`, whose engines a program may build and drop one after another)."""
    gc.collect()
    gc.freeze()


def build_async_engine(config: EngineConfig, **kwargs: Any) -> AsyncLLMEngine:
    """`build_engine` (in the calling thread) wrapped for serving; call `start()` to serve."""
    return AsyncLLMEngine(build_engine(config), **kwargs)

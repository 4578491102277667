"""The engine's start-up objects leave the cyclic garbage collector's reach (a full collection
over them stalls serving): after `build_engine` they are frozen."""

from __future__ import annotations

import gc

from flexserve.config import CacheConfig, EngineConfig, ModelConfig
from flexserve.entrypoints.engine_builder import build_engine


def test_build_engine_freezes_the_start_up_objects(tiny_checkpoint, tiny_config):
    path = tiny_checkpoint(tiny_config("llama"))
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    try:
        build_engine(EngineConfig(model=ModelConfig(model=path, device="cpu"),
                                           cache=CacheConfig(num_blocks=16)))
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()

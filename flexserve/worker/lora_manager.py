"""The worker side of multi-LoRA: slot-stacked LoRA linears, a host-memory LRU of adapters, and
the copies into device slots that a plan asks for.

The linears hold `max_loras` serving slots, then the fine-tuning slots (`flexserve.engine.
finetune_capacity`), sized here at start-up from the fine-tuning memory budget, then (when there
are fine-tuning slots) the staging slot of the jobs' backward windows.

The engine's `AdapterManager` decides which adapter goes into which slot; this class only does
what a plan's `lora_slot_loads` says. Reading from disk happens in `add` (called off the engine
thread by servers) or, for an adapter the LRU has dropped since, when a slot load needs it again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from flexserve.config import FinetuneConfig, LoRAConfig
from flexserve.engine.finetune_capacity import (
    JOB_MEMORY_FRACTION,
    STATE_BYTES_PER_PARAM,
    finetune_slot_count,
)
from flexserve.engine.lora_request import LoRARequest
from flexserve.layers.lora_linear import LoRALinear
from flexserve.model.llama import PPMissingLayer
from flexserve.peft.bypass import TARGET_MODULES, target_shapes
from flexserve.peft.lora import LoRAAdapter
from flexserve.peft.peft_io import load_peft_adapter

logger = logging.getLogger(__name__)


def attach_lora_linears(
    model: nn.Module, max_loras: int, max_rank: int
) -> dict[tuple[int, str], LoRALinear]:
    """Replace every target projection of `model.model.layers` by a `LoRALinear` sharing its
    weights (parameter names do not change); returns them by (layer, target). A pipeline
    stage has its own layers' only."""
    modules = {}
    for index, layer in enumerate(model.model.layers):
        if isinstance(layer, PPMissingLayer):
            continue
        for target, parent_name in TARGET_MODULES.items():
            parent = getattr(layer, parent_name)
            base = getattr(parent, target)
            if not isinstance(base, LoRALinear):
                base = LoRALinear(base, max_loras, max_rank, index, target)
                setattr(parent, target, base)
            modules[(index, target)] = base
    return modules


def finetune_budget_bytes(config: FinetuneConfig | None, device: torch.device) -> int:
    """Bytes for fine-tuning jobs' slots and state: `job_memory_gib`, else JOB_MEMORY_FRACTION of
    the device's memory (physical host memory on the CPU)."""
    if config is not None and config.job_memory_gib is not None:
        return int(config.job_memory_gib * (1 << 30))
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(JOB_MEMORY_FRACTION * total)


class LoRAManager:
    """Owns the LoRA side of one model on one device."""

    def __init__(
        self, model: nn.Module, lora_config: LoRAConfig, hf_config: Any,
        device: torch.device, dtype: torch.dtype, finetune_config: FinetuneConfig | None = None,
    ) -> None:
        self.config = lora_config
        self.device = device
        self.dtype = dtype
        self.shapes = target_shapes(hf_config)
        self.num_layers = hf_config.num_hidden_layers
        element = torch.empty((), dtype=dtype).element_size()
        # One slot on every target linear of every layer, A and B at max_lora_rank, plus scaling.
        self.slot_bytes = self.num_layers * sum(
            lora_config.max_lora_rank * (n_in + n_out) * element + 4
            for n_in, n_out in self.shapes.values())
        # Under tensor parallelism this rank holds its shard of every adapter
        # (`TensorParallelLayout.lora_shard`); slots are counted at their whole size here, so
        # every rank counts the same number of them.
        layout = getattr(model, "layout", None)
        self.layout = layout if layout is not None and layout.world_size > 1 else None
        budget = finetune_budget_bytes(finetune_config, device)
        self.num_finetune_slots = finetune_slot_count(
            lora_config.max_finetune_loras, self.slot_bytes, budget)
        # One more slot after the jobs' that no job or adapter holds: a job's backward windows
        # run with its layer's weights and scaling copied there, so the captured backward
        # graphs, which read that slot, serve the jobs of one plan in any slot
        # (`flexserve.worker.finetune.backward_graphs`).
        self.staging_slot = (lora_config.max_loras + self.num_finetune_slots
                             if self.num_finetune_slots else None)
        num_slots = self.num_finetune_slots + (self.staging_slot is not None)
        # What the jobs' training state may take: the budget less the slots.
        self.finetune_state_bytes = max(budget - num_slots * self.slot_bytes, 0)
        self.modules = attach_lora_linears(
            model, lora_config.max_loras + num_slots, lora_config.max_lora_rank)
        if self.layout is not None or len(self.modules) != self.num_layers * len(self.shapes):
            # this rank's shard of a slot, over its pipeline stage's layers
            self.slot_bytes = sum(m.lora_a[0].nbytes + m.lora_b[0].nbytes + 4
                                  for m in self.modules.values())
        fold = getattr(model, "fold_lora_shrinks", None)
        if fold is not None:  # merged GEMMs (GPU path): decode shrinks ride in them
            num_folded = fold()
            if num_folded:
                logger.info("LoRA shrinks folded into %d merged GEMMs", num_folded)
        self.slot_ids = [0] * lora_config.max_loras  # lora_int_id held by each slot; 0: empty
        self._cache: OrderedDict[int, LoRAAdapter] = OrderedDict()  # by lora_int_id, LRU first
        self._lock = threading.Lock()  # `add` runs on server threads, slot loads on the engine's
        logger.info(
            "LoRA: %d serving slots and %d fine-tuning slots of rank %d on %d linears (%.1f MiB "
            "per slot); host cache: %d adapters; fine-tuning jobs' training state: %.1f MiB "
            "(%d bytes per adapter parameter)", lora_config.max_loras, self.num_finetune_slots,
            lora_config.max_lora_rank, len(self.modules), self.slot_bytes / (1 << 20),
            lora_config.max_cpu_loras, self.finetune_state_bytes / (1 << 20),
            STATE_BYTES_PER_PARAM,
        )

    @property
    def num_cpu_loras(self) -> int:
        return len(self._cache)

    def read(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read and validate an adapter from disk (no caching); ValueError with the reason."""
        adapter = load_peft_adapter(
            lora_request.lora_path, self.shapes, self.num_layers, self.config.max_lora_rank,
            self.config.allowed_dir_for(lora_request.lora_path), dtype=self.dtype,
        )
        return adapter.to(pin_memory=self.device.type == "cuda")

    def add(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read an adapter into the host cache (evicting the least recently used beyond
        max_cpu_loras); thread-safe. ValueError with the reason when it cannot be served."""
        adapter = self.read(lora_request)
        with self._lock:
            self._cache[lora_request.lora_int_id] = adapter
            self._cache.move_to_end(lora_request.lora_int_id)
            while len(self._cache) > self.config.max_cpu_loras:
                self._cache.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> None:
        """Drop an adapter's host copy (its device slot is simply reused later); thread-safe."""
        with self._lock:
            self._cache.pop(lora_int_id, None)

    def get(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter from the host cache, read again from disk if it was evicted."""
        with self._lock:
            adapter = self._cache.get(lora_request.lora_int_id)
            if adapter is not None:
                self._cache.move_to_end(lora_request.lora_int_id)
                return adapter
        logger.info("LoRA adapter %r is not in the host cache; reading %s again",
                    lora_request.lora_name, lora_request.lora_path)
        return self.add(lora_request)

    @torch.no_grad()
    def load_slots(self, loads: dict[int, LoRARequest]) -> dict[int, str]:
        """Copy each adapter into its slot; returns lora_int_id -> reason for those that failed.

        A failed adapter's slot is cleared, so its rows compute the base model this step; the
        engine drops those tokens and ends the requests.
        """
        errors = {}
        for slot, lora_request in loads.items():
            try:
                adapter = self.get(lora_request)
            except (ValueError, OSError) as e:
                logger.error("cannot load LoRA adapter %r: %s", lora_request.lora_name, e)
                errors[lora_request.lora_int_id] = str(e)
                self.clear_slot(slot)
                continue
            for (layer, target), module in self.modules.items():
                pair = adapter.weights.get((layer, target))
                if pair is None:
                    module.set_slot(slot, None, None)
                    continue
                if self.layout is not None:
                    pair = self.layout.lora_shard(target, *pair)
                module.set_slot(slot, pair[0], pair[1], adapter.scaling)
            self.slot_ids[slot] = lora_request.lora_int_id
        return errors

    def clear_slot(self, slot: int) -> None:
        for module in self.modules.values():
            module.set_slot(slot, None, None)
        if slot < len(self.slot_ids):  # a serving slot (fine-tuning slots come after them)
            self.slot_ids[slot] = 0

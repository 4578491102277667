"""Room for fine-tuning jobs: their own LoRA slots and the memory of their training state.

A running job holds one fine-tuning slot (device LoRA weights in the model's dtype, `max_lora_rank`
wide, numbered after the `max_loras` serving slots, so serving adapters never compete with jobs)
and its training state: fp32 adapter masters, gradients and AdamW's two moments, 16 bytes per
adapter parameter, for its own rank and target modules. Both come out of one budget fixed at
start-up (`FinetuneConfig.job_memory_gib`, by default a fraction of the device's memory): the
slots are allocated then, the states as jobs start. A job starts when a slot is free and its state
fits what the running jobs leave; otherwise it waits (`FinetuneCapacityError` says why), and a job
whose state alone exceeds the budget is refused outright (ValueError).
Pure Python: the worker sizes the slots (`finetune_slot_count`) and reports the numbers in
`ModelInfo`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# Bytes of training state per adapter parameter: fp32 master, gradient, AdamW exp_avg, exp_avg_sq.
STATE_BYTES_PER_PARAM = 16
# Unless configured, the fine-tuning budget is this fraction of the device's memory.
JOB_MEMORY_FRACTION = 0.05
# Sized from memory, at most this many fine-tuning slots (each one widens the slot-stacked LoRA
# weights that every LoRA kernel indexes).
MAX_AUTO_FINETUNE_SLOTS = 32

MIB = 1 << 20


class FinetuneCapacityError(ValueError):
    """No fine-tuning slot or not enough memory for the job's state now; it may start later."""


def finetune_slot_count(configured: int | None, slot_bytes: int, budget_bytes: int) -> int:
    """Fine-tuning slots: `configured` when set, else as many as half the budget holds (the
    other half is for the jobs' states), between 1 and MAX_AUTO_FINETUNE_SLOTS."""
    if configured is not None:
        return configured
    return max(1, min(MAX_AUTO_FINETUNE_SLOTS, budget_bytes // 2 // max(slot_bytes, 1)))


def adapter_num_params(num_layers: int, target_features: dict[str, tuple[int, int]], rank: int,
                       targets: list[str] | tuple[str, ...]) -> int:
    """Parameters of a LoRA adapter: r * (in + out) per targeted linear and layer."""
    unknown = sorted(set(targets) - set(target_features))
    if unknown:
        raise ValueError(f"unknown LoRA target modules {unknown}")
    return num_layers * rank * sum(sum(target_features[t]) for t in set(targets))


def adapter_shape(path: str, rank: int, targets: list[str] | tuple[str, ...]
                  ) -> tuple[int, tuple[str, ...]]:
    """(rank, target modules) of the PEFT adapter a job starts from (its adapter_config.json),
    else the given ones (the worker reports a missing or broken adapter itself)."""
    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        found = config.get("target_modules")
        if isinstance(config.get("r"), int) and isinstance(found, list) and found:
            return config["r"], tuple(str(t) for t in found)
    except (OSError, ValueError, AttributeError):
        pass
    return rank, tuple(targets)


@dataclass(slots=True)
class FinetuneCapacity:
    """Which fine-tuning slots and how much state memory the running jobs hold."""

    first_slot: int  # the first fine-tuning slot (= max_loras)
    num_slots: int  # fine-tuning slots
    state_budget_bytes: int  # for the jobs' states (the budget less the slots)
    num_layers: int
    target_features: dict[str, tuple[int, int]]  # target module -> (in, out) features
    _jobs: dict[str, tuple[int, int]] = field(default_factory=dict)  # job id -> (slot, bytes)

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    @property
    def used_state_bytes(self) -> int:
        return sum(num_bytes for _, num_bytes in self._jobs.values())

    def state_bytes(self, rank: int, targets: list[str] | tuple[str, ...]) -> int:
        return STATE_BYTES_PER_PARAM * adapter_num_params(self.num_layers, self.target_features,
                                                          rank, targets)

    def check_fits(self, rank: int, targets: list[str] | tuple[str, ...]) -> int:
        """The state bytes of a job of this rank and targets; ValueError when they exceed the
        whole budget (the job could never start)."""
        need = self.state_bytes(rank, targets)
        if need > self.state_budget_bytes:
            raise ValueError(
                f"the job's training state (rank {rank} on {len(set(targets))} target modules: "
                f"{need / MIB:.1f} MiB of fp32 weights, gradients and AdamW moments) exceeds the "
                f"{self.state_budget_bytes / MIB:.1f} MiB fine-tuning jobs have: lower the rank "
                "or the target modules, or raise --finetune-job-memory-gib")
        return need

    def reserve(self, job_id: str, rank: int, targets: list[str] | tuple[str, ...]) -> int:
        """A free slot for the job, its state counted; FinetuneCapacityError when it must wait,
        ValueError when it can never fit."""
        if job_id in self._jobs:
            raise ValueError(f"fine-tuning job {job_id!r} holds a slot already")
        need = self.check_fits(rank, targets)
        taken = {slot for slot, _ in self._jobs.values()}
        free = [s for s in range(self.first_slot, self.first_slot + self.num_slots)
                if s not in taken]
        if not free:
            raise FinetuneCapacityError(
                f"all {self.num_slots} fine-tuning slots are held by running jobs")
        available = self.state_budget_bytes - self.used_state_bytes
        if need > available:
            raise FinetuneCapacityError(
                f"the job's training state needs {need / MIB:.1f} MiB and {available / MIB:.1f} "
                f"of {self.state_budget_bytes / MIB:.1f} MiB are free ({self.num_jobs} jobs "
                "running)")
        self._jobs[job_id] = (free[0], need)
        return free[0]

    def release(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def describe(self) -> str:
        return (f"{self.num_slots} fine-tuning LoRA slots (from slot {self.first_slot}), "
                f"{self.state_budget_bytes / MIB:.1f} MiB for jobs' training state")

"""The fine-tuning half of the hybrid token scheduler: after the inference rows of a step, the
remaining token budget goes to fine-tuning windows (FlexLLM section 6.1, algorithm 2).

A job trains its examples in the order of its optimizer steps; the sequences of one step run one
after another, each in two phases:

- forward: windows [l_i, l_i + s_i) in order, each one more row of the step's flat batch (same
  forward call as the inference rows, K/V into the paged cache), s_i = the budget left;
- backward: layers from the top; inside a layer, windows [l_j - s_j, l_j) from the end of the
  sequence to the start, each window counting its tokens against the budget (so one step may hold
  several layer-windows, or a window may span steps).

The sequence's KV blocks are allocated in full when it starts (FlexLLM's admission rule: only
if they all fit) and freed after its last backward window (layer 0, position 0) ran. The blocks
are shared by all layers (one block id covers that block in every layer's cache), so they are not
released layer by layer. After a step's last sequence, the plan carries the job's optimizer step.
Pure Python: the worker owns every tensor (activations, gradients, optimizer state).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from flexserve.engine.plan import BackwardWindow, BatchPlan, FinetuneSequenceStart, FinetuneWindow


class FinetuneJobStatus(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(slots=True)
class TrainingSequence:
    """One example as the scheduler sees it: its tokens and loss mask."""

    token_ids: list[int]
    loss_mask: list[bool]  # loss_mask[p]: token p counts in the loss (predicted from p - 1)


class _SequenceKV:
    """The KV-cache owner of a running fine-tuning sequence (what KVCacheManager reads)."""

    __slots__ = ("request_id", "all_token_ids", "num_computed_tokens", "block_hashes")
    lora_int_id = 0  # blocks are never shared through the prefix cache

    def __init__(self, request_id: str, token_ids: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = token_ids
        self.num_computed_tokens = 0
        self.block_hashes: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass(slots=True)
class _RunningSequence:
    sequence_id: int
    kv: _SequenceKV
    length: int
    num_forward_tokens: int = 0  # positions whose forward window has been scheduled
    backward_layer: int = -1  # layer of the next backward window; -1: forward phase
    backward_end: int = 0  # the next backward window ends here


@dataclass(slots=True)
class FinetuneJobState:
    """A job as the engine tracks it."""

    job_id: str
    sequences: list[TrainingSequence]  # the examples
    steps: list[list[int]]  # example indices of each optimizer step, in order
    lora_slot: int  # device slot holding the job's adapter for its whole run
    status: FinetuneJobStatus = FinetuneJobStatus.RUNNING
    error: str | None = None
    step_index: int = 0  # optimizer steps done
    next_example: int = 0  # position in steps[step_index] of the next sequence to start
    running: _RunningSequence | None = None
    num_sequences_started: int = 0
    step_loss_sum: float = 0.0
    step_loss_count: int = 0
    losses: list[float] = field(default_factory=list)  # mean token loss of each optimizer step
    grad_norms: list[float] = field(default_factory=list)  # pre-clip norm of each step
    num_forward_tokens: int = 0  # windows' tokens scheduled so far (metrics)
    num_backward_tokens: int = 0  # layer-window tokens of backward windows scheduled so far
    events: list[str] = field(default_factory=list)  # human-readable progress, oldest first
    slot_released: bool = False  # the engine gave its LoRA slot back after it ended

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def finished(self) -> bool:
        return self.status != FinetuneJobStatus.RUNNING


class FinetuneScheduler:
    """Places fine-tuning windows into plans; owns the engine-side state of every job."""

    def __init__(self, kv_cache_manager, num_layers: int, max_finetune_len: int) -> None:
        self.kv = kv_cache_manager
        self.num_layers = num_layers
        self.max_finetune_len = max_finetune_len
        self.jobs: dict[str, FinetuneJobState] = {}  # every job not yet removed, in start order

    def add_job(self, job: FinetuneJobState) -> None:
        if job.job_id in self.jobs:
            raise ValueError(f"fine-tuning job {job.job_id!r} exists already")
        for i, seq in enumerate(job.sequences):
            if not 2 <= len(seq.token_ids) <= self.max_finetune_len:
                raise ValueError(f"example {i} has {len(seq.token_ids)} tokens; fine-tuning "
                                 f"sequences need 2 to max_finetune_len={self.max_finetune_len}")
            if len(seq.loss_mask) != len(seq.token_ids):
                raise ValueError(f"example {i}: loss_mask and token_ids differ in length")
            blocks = -(-len(seq.token_ids) // self.kv.block_size)
            if blocks > self.kv.num_blocks:
                # It would wait for blocks forever: even an idle cache cannot hold it.
                raise ValueError(f"example {i} has {len(seq.token_ids)} tokens; the KV cache holds "
                                 f"{self.kv.num_blocks * self.kv.block_size}")
        self.jobs[job.job_id] = job

    def has_work(self) -> bool:
        return any(not job.finished for job in self.jobs.values())

    # ---------------------------------------------------------------------------- scheduling
    def schedule(self, plan: BatchPlan, budget: int) -> int:
        """Add fine-tuning work to `plan` within `budget` tokens; returns the budget left."""
        for job in self.jobs.values():
            if job.finished:
                continue
            if budget <= 0:
                break
            budget = self._schedule_job(plan, job, budget)
        return budget

    def _schedule_job(self, plan: BatchPlan, job: FinetuneJobState, budget: int) -> int:
        seq = job.running
        if seq is None:
            seq = self._start_sequence(plan, job)
            if seq is None:
                return budget  # its KV blocks do not fit now; inference keeps the memory
        if seq.backward_layer < 0:  # forward phase: one window, one row
            n = min(budget, seq.length - seq.num_forward_tokens)
            plan.finetune_windows.append(FinetuneWindow(
                job.job_id, seq.sequence_id, seq.num_forward_tokens,
                seq.num_forward_tokens + n, job.lora_slot))
            seq.num_forward_tokens += n
            seq.kv.num_computed_tokens += n
            job.num_forward_tokens += n
            plan.num_batched_tokens += n
            if seq.num_forward_tokens == seq.length:
                seq.backward_layer, seq.backward_end = self.num_layers - 1, seq.length
            return budget - n
        while budget > 0 and seq.backward_layer >= 0:
            n = min(budget, seq.backward_end)
            plan.backward_windows.append(BackwardWindow(
                job.job_id, seq.sequence_id, seq.backward_layer, seq.backward_end - n,
                seq.backward_end))
            budget -= n
            job.num_backward_tokens += n
            seq.backward_end -= n
            if seq.backward_end == 0:
                seq.backward_layer -= 1
                seq.backward_end = seq.length
        if seq.backward_layer < 0:  # its last window is in this plan
            plan.finished_finetune_sequences.append((job.job_id, seq.sequence_id))
            job.next_example += 1
            if job.next_example == len(job.steps[job.step_index]):
                plan.optimizer_steps.append(job.job_id)
        return budget

    def _start_sequence(self, plan: BatchPlan, job: FinetuneJobState) -> _RunningSequence | None:
        example = job.sequences[job.steps[job.step_index][job.next_example]]
        sequence_id = job.num_sequences_started
        kv = _SequenceKV(f"finetune:{job.job_id}:{sequence_id}", example.token_ids)
        if self.kv.allocate_slots(kv, kv.num_tokens, cache_blocks=False) is None:
            return None
        step_examples = job.steps[job.step_index]
        num_loss_tokens = sum(sum(job.sequences[i].loss_mask) for i in step_examples)
        job.num_sequences_started += 1
        plan.finetune_starts.append(FinetuneSequenceStart(
            job.job_id, sequence_id, example.token_ids, example.loss_mask,
            loss_scale=1.0 / max(num_loss_tokens, 1),
            block_ids=self.kv.get_block_ids(kv.request_id)))
        job.running = _RunningSequence(sequence_id, kv, kv.num_tokens)
        return job.running

    # ------------------------------------------------------------------------------- results
    def update(self, plan: BatchPlan, losses: dict, grad_norms: dict[str, float],
               errors: dict[str, str]) -> list[FinetuneJobState]:
        """Fold a step's results in; returns the jobs whose state changed (for events)."""
        changed: dict[str, FinetuneJobState] = {}
        for (job_id, _), (loss_sum, count) in losses.items():
            job = self.jobs.get(job_id)
            if job is not None:
                job.step_loss_sum += loss_sum
                job.step_loss_count += count
                changed[job_id] = job
        for job_id, sequence_id in plan.finished_finetune_sequences:
            job = self.jobs.get(job_id)
            if job is not None and job.running is not None \
                    and job.running.sequence_id == sequence_id:
                self.kv.free(job.running.kv)
                job.running = None
        for job_id in plan.optimizer_steps:
            job = self.jobs.get(job_id)
            if job is None or job.finished:
                continue
            job.losses.append(job.step_loss_sum / max(job.step_loss_count, 1))
            job.grad_norms.append(grad_norms.get(job_id, float("nan")))
            job.events.append(f"Step {job.step_index + 1}/{job.num_steps}: training loss="
                              f"{job.losses[-1]:.4f}, grad norm={job.grad_norms[-1]:.4f}")
            job.step_loss_sum, job.step_loss_count = 0.0, 0
            job.step_index += 1
            job.next_example = 0
            if job.step_index == job.num_steps:
                job.status = FinetuneJobStatus.SUCCEEDED
                job.events.append("The job has successfully completed.")
            changed[job_id] = job
        for job_id, reason in errors.items():
            job = self.jobs.get(job_id)
            if job is not None and not job.finished:
                self.end_job(job_id, FinetuneJobStatus.FAILED, reason)
                job.events.append(f"The job failed: {reason}")
                changed[job_id] = job
        return list(changed.values())

    def end_job(self, job_id: str, status: FinetuneJobStatus, error: str | None = None) -> None:
        """Stop a job (cancel, failure): its sequence's KV blocks are freed now."""
        job = self.jobs[job_id]
        if job.running is not None:
            self.kv.free(job.running.kv)
            job.running = None
        job.status = status
        job.error = error

    def remove_job(self, job_id: str) -> None:
        job = self.jobs.pop(job_id, None)
        if job is not None and job.running is not None:
            self.kv.free(job.running.kv)


"""The contract between the scheduler and the worker: one `BatchPlan` in, one `StepResult` out.

Plain Python only (ints, lists, params objects): no tensors cross the engine/worker boundary.
A row is a contiguous run of a sequence's tokens whose KV goes into the paged cache at positions
[num_computed_tokens, num_computed_tokens + len(new_token_ids)). Chunked prefill, decode and
forward windows of fine-tuning sequences are all rows of this one shape; backward windows and
optimizer steps of fine-tuning jobs run after the forward in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flexserve.engine.lora_request import LoRARequest
from flexserve.sampling_params import SamplingParams

# The token of a `continues_previous` row, unknown to the host when the plan is built.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class ScheduledSequence:
    """One request's share of an iteration."""

    request_id: str  # the engine's id of the request
    new_token_ids: list[int]  # tokens fed this step; len = number of scheduled tokens
    num_computed_tokens: int  # tokens already in the KV cache = position of new_token_ids[0]
    block_ids: list[int]  # the request's whole block table (covers the new tokens too)
    needs_sample: bool  # this row reaches the end of the known tokens: sample the next one
    sampling_params: SamplingParams  # how to sample / which logprobs to return
    prompt_token_ids: list[int]  # the prompt (penalties, prompt logprobs); shared, do not mutate
    output_token_ids: list[int]  # generated so far (penalties, min_tokens); shared, do not mutate
    eos_token_id: int | None  # masked while fewer than min_tokens are generated
    seed: int | None  # effective seed; the sampler derives a per-step generator from it
    lora_slot: int = -1  # device slot of the request's LoRA adapter; -1: base model only

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.new_token_ids)


@dataclass(slots=True)
class FinetuneSequenceStart:
    """A fine-tuning sequence the worker starts keeping activations and gradients for."""

    job_id: str  # the fine-tuning job
    sequence_id: int  # unique within the job
    token_ids: list[int]  # the whole training sequence
    loss_mask: list[bool]  # loss_mask[p]: token p is predicted from p-1 and counts in the loss
    loss_scale: float  # 1 / loss tokens of the optimizer step the sequence belongs to
    block_ids: list[int]  # KV blocks holding all of its positions (allocated up front)
    # True: a DPO reference sequence: its windows return the log-probabilities of its loss
    # tokens and keep no activations (it has no backward)
    reference: bool = False


@dataclass(slots=True)
class FinetuneWindow:
    """A forward window [start, end) of a fine-tuning sequence: one more row of the flat batch,
    after the inference rows (FlexLLM algorithm 2, lines 3-11)."""

    job_id: str
    sequence_id: int
    start: int  # first position (its predecessors' K/V are in the cache)
    end: int  # one past the last position
    lora_slot: int  # device slot of the job's adapter


@dataclass(slots=True)
class BackwardWindow:
    """Backward of one decoder layer over positions [start, end) of a sequence (algorithm 2,
    lines 13-21): layers from the top, windows from the end of the sequence."""

    job_id: str
    sequence_id: int
    layer: int
    start: int
    end: int


@dataclass(slots=True)
class BatchPlan:
    """What one `EngineCore.step()` runs. Rows are in execution order."""

    sequences: list[ScheduledSequence] = field(default_factory=list)  # inference rows
    num_batched_tokens: int = 0  # sum of new tokens over all rows (<= the token budget)
    preempted_request_ids: list[str] = field(default_factory=list)  # lost their KV this step
    finished_request_ids: list[str] = field(default_factory=list)  # ended since the last plan
    num_new_prefix_cache_hit_tokens: int = 0  # prompt tokens served from the prefix cache
    num_new_prefix_cache_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    # slot -> adapter to copy into that device slot before this forward (its rows use the slot)
    lora_slot_loads: dict[int, LoRARequest] = field(default_factory=dict)
    # fine-tuning work, run in this order: sequences to start, forward windows (rows after the
    # inference rows, same forward call), backward windows, then optimizer steps of these jobs
    finetune_starts: list[FinetuneSequenceStart] = field(default_factory=list)
    finetune_windows: list[FinetuneWindow] = field(default_factory=list)
    backward_windows: list[BackwardWindow] = field(default_factory=list)
    optimizer_steps: list[str] = field(default_factory=list)  # job ids
    finished_finetune_sequences: list[tuple[str, int]] = field(default_factory=list)  # drop state
    # (job id, sequence id, factor): multiply the sequence's loss gradient by factor before its
    # first backward window in this plan runs (a DPO pair's coefficient, known after the forward)
    finetune_grad_scales: list[tuple[str, int, float]] = field(default_factory=list)
    # spatial sharing: the fine-tuning windows run as their own forward on a second CUDA stream,
    # concurrently with the inference rows, instead of as rows of the same forward
    finetune_concurrent: bool = False
    # asynchronous scheduling: row i feeds the token sampled for row i of the previous plan,
    # which is still on the device when this plan is built (its new_token_ids hold
    # PLACEHOLDER_TOKEN_ID); see `Scheduler.schedule_continuation`
    continues_previous: bool = False

    @property
    def is_empty(self) -> bool:
        return not (self.sequences or self.finetune_windows or self.backward_windows
                    or self.optimizer_steps or self.finished_finetune_sequences)

    @property
    def has_finetune_work(self) -> bool:
        """Fine-tuning state changes in this step (sequences start, run, end, or a job steps)."""
        return bool(self.finetune_starts or self.finetune_windows or self.backward_windows
                    or self.optimizer_steps or self.finished_finetune_sequences)


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one position, from the raw logits (before penalties/temperature)."""

    token_ids: list[int]  # the chosen (or actual prompt) token first, then top-k by rank
    logprobs: list[float]  # log-softmax values aligned with token_ids
    ranks: list[int]  # 1-based vocabulary rank of each entry


@dataclass(slots=True)
class StepResult:
    """What the worker returns for a `BatchPlan`."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # rows with needs_sample
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # when params.logprobs set
    # request id -> one entry per prompt token position covered by this step's row, for the
    # tokens at positions num_computed_tokens+1 ... (position 0 has no logprob and gets None)
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    execute_time: float = 0.0  # seconds spent in the worker
    # lora_int_id -> why its slot load failed; the engine ends those requests, drops their tokens
    lora_load_errors: dict[int, str] = field(default_factory=dict)
    # (job id, sequence id) -> (sum of token cross-entropies, loss tokens, loss tokens whose
    # target is the argmax of its logits) of this step's windows
    finetune_losses: dict[tuple[str, int], tuple[float, int, int]] = field(default_factory=dict)
    grad_norms: dict[str, float] = field(default_factory=dict)  # job id -> pre-clip norm, per step
    finetune_errors: dict[str, str] = field(default_factory=dict)  # job id -> why it failed

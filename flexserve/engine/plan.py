"""The contract between the scheduler and the worker: one `BatchPlan` in, one `StepResult` out.

Plain Python only (ints, lists, params objects): no tensors cross the engine/worker boundary.
A row is a contiguous run of a sequence's tokens whose KV goes into the paged cache at positions
[num_computed_tokens, num_computed_tokens + len(new_token_ids)). Chunked prefill, decode and, in
the fine-tuning issue, forward windows of training sequences are all rows of this one shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flexserve.engine.lora_request import LoRARequest
from flexserve.sampling_params import SamplingParams


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

    @property
    def is_empty(self) -> bool:
        return not self.sequences


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

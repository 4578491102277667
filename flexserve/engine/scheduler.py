"""The inference scheduler: one `BatchPlan` per step, vLLM v1 style, with FlexLLM admission.

There are no prefill and decode phases. Every running request has `num_computed_tokens` catching
up to `num_tokens`; a step gives each, in admission order, as many tokens as the shared budget
(`max_num_batched_tokens`) allows, so a long prompt is prefilled in chunks and decodes (one token)
ride along. When blocks run out, the most recently admitted request is preempted and later
recomputed from scratch (its cached prefix blocks usually survive). A waiting request is admitted
only if blocks for all of its tokens fit (FlexLLM section 7), so admitted prompts do not evict
each other halfway through a chunked prefill.

With LoRA, a request also needs its adapter in one of `max_loras` device slots (see
`AdapterManager`). A waiting request whose adapter is not resident while every slot is pinned by
running requests is skipped, and the requests behind it may be admitted: strict FCFS would let one
cold adapter idle the whole batch until a slot drains. To keep the skipped request from starving
under steady traffic on the resident adapters, it claims one of them (the one with the fewest
running requests): later arrivals for the claimed adapter wait too, so its slot drains and passes
to the skipped request. Skipping applies only to slots; a request that does not fit in free KV
blocks still blocks everyone behind it, as before.

Waiting requests are admitted tenant by tenant with the Virtual Token Counter (FlexLLM appendix C):
the earliest request of the least-served tenant goes first, so with one tenant this is FCFS. After
the inference rows, `HybridTokenScheduler` adds the fine-tuning work the sharing policy and the
latency model allow (FlexLLM 6.2).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from flexserve.config import (
    CacheConfig,
    CoserveConfig,
    FinetuneConfig,
    LoRAConfig,
    SchedulerConfig,
)
from flexserve.engine.adapter_manager import AdapterManager
from flexserve.engine.finetune_scheduler import FinetuneScheduler
from flexserve.engine.hybrid_scheduler import HybridTokenScheduler, StepMode
from flexserve.engine.kv_cache_manager import KVCacheManager, cdiv
from flexserve.engine.online_latency_model import OnlineLatencyModel
from flexserve.engine.plan import (
    PLACEHOLDER_TOKEN_ID,
    BatchPlan,
    ScheduledSequence,
    StepResult,
)
from flexserve.engine.request import Request, RequestStatus


class Scheduler:
    """Decides which tokens of which requests run each step and applies the sampled results."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        lora_config: LoRAConfig | None = None,
        num_layers: int = 0,
        max_finetune_len: int | None = None,
        coserve_config: CoserveConfig | None = None,
        latency_model: OnlineLatencyModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        vocab_size: int | None = None,
        finetune_config: FinetuneConfig | None = None,
    ) -> None:
        if type(max_model_len) is not int or max_model_len <= 0:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests go back to the front
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.finished_request_ids: list[str] = []  # ended, not yet sent in a plan with rows
        self.num_preemptions_total = 0
        # Adapter registry and device slots; None when LoRA is disabled.
        self.adapter_manager = (
            None if lora_config is None else AdapterManager(lora_config.max_loras)
        )
        # Fine-tuning windows fill the budget the inference rows leave (FlexLLM 6.1).
        finetune_config = finetune_config or FinetuneConfig()
        self.finetune = FinetuneScheduler(
            self.kv_cache_manager, num_layers, max_finetune_len or max_model_len, vocab_size,
            finetune_config.packing_time_limit_s, finetune_config.max_length_buckets,
            lockstep_jobs=finetune_config.batched_backward)
        # Sizes the fine-tuning windows (latency model, sharing policy) and keeps the fairness
        # counters of tenants and jobs (FlexLLM 6.2, appendices A and C).
        self.clock = clock
        self.hybrid = HybridTokenScheduler(
            coserve_config or CoserveConfig(slo_tpot_ms=None), scheduler_config, num_layers,
            latency_model, clock)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError if it could never run in this engine."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is not a fresh waiting request")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt must contain at least one token")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens exceeds max_model_len "
                f"{self.max_model_len}"
            )
        # The last generated token is never fed back, so the KV cache holds at most this many
        # tokens of the request; if they cannot fit even alone, it would wait forever.
        max_kv_tokens = max(
            request.num_prompt_tokens,
            min(request.num_prompt_tokens + request.max_tokens, self.max_model_len) - 1,
        )
        num_blocks_needed = cdiv(max_kv_tokens, self.block_size)
        if num_blocks_needed > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} may need {num_blocks_needed} KV blocks, "
                f"the cache has {self.kv_cache_manager.num_blocks}"
            )
        if request.lora_request is not None:
            if self.adapter_manager is None:
                raise ValueError("LoRA is not enabled in this engine")
            self.adapter_manager.add_request(request.request_id, request.lora_int_id)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.hybrid.request_queued(request)
        self.hybrid.num_arrivals += 1

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string): frees their blocks now.

        Unknown or already finished ids are ignored: an abort may race with a natural finish.
        """
        if not status.finished:
            raise ValueError(f"{status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        ended = set()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.WAITING:
                self.waiting.remove(request)
                self.hybrid.request_dequeued(request)
            else:
                ended.add(request_id)
            request.status = status
            self._free_request(request)
        if ended:
            self.running = [r for r in self.running if r.request_id not in ended]

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.requests.get(request_id)

    def fail_adapters(self, errors: dict[int, str]) -> dict[str, str]:
        """The worker could not load these adapters (lora_int_id -> reason): stop serving them
        and abort every request that uses them. Returns request id -> reason.

        Call before `update`, so the tokens those rows produced this step are dropped.
        """
        if self.adapter_manager is None or not errors:
            return {}
        failed = {}
        for lora_int_id, reason in errors.items():
            lora_request = self.adapter_manager.get(lora_int_id)
            if lora_request is None:
                continue
            message = f"The lora adapter '{lora_request.lora_name}' could not be loaded: {reason}"
            failed.update({
                request_id: message
                for request_id, request in self.requests.items()
                if request.lora_int_id == lora_int_id
            })
            self.adapter_manager.mark_failed(lora_int_id)
        self.finish_requests(list(failed), RequestStatus.FINISHED_ABORTED)
        return failed

    # ------------------------------------------------------------------ the step

    def schedule(self) -> BatchPlan:
        """Pick this step's rows. Advances each scheduled request's `num_computed_tokens` now.

        Advancing at schedule time (as vLLM v1 does) means the counters already describe the
        KV cache as it will be after this plan runs, so a pipelined engine could schedule the
        next step before `update`; rows record the pre-step value in `num_computed_tokens`.
        """
        plan = BatchPlan()
        budget = self.scheduler_config.max_num_batched_tokens
        mode = self.hybrid.mode(bool(self.running or self.waiting), self.finetune.has_work())
        if mode != StepMode.FINETUNE:  # a temporal-sharing phase holds the inference rows back
            budget = self._schedule_running(plan, budget)
            # Admitting while running requests are being preempted would only thrash (vLLM
            # does the same).
            if not plan.preempted_request_ids:
                budget = self._admit_waiting(plan, budget)
        self.hybrid.schedule_finetune(plan, self.finetune, mode, self.waiting)
        self.hybrid.finish_step(plan, len(self.waiting))
        # An empty plan may never reach the worker, so ended ids wait for one that has rows.
        if not plan.is_empty:
            plan.finished_request_ids = self.finished_request_ids
            self.finished_request_ids = []
        return plan

    def schedule_continuation(self, previous: BatchPlan) -> BatchPlan | None:
        """The next step after `previous`, built before `previous` ran to completion
        (asynchronous scheduling: the host prepares step N+1 while the device runs step N).

        Every running request is a row of `previous` that samples a token, in order; row i of
        the new plan feeds the token sampled for row i of `previous` (`continues_previous`).
        Under co-serving the plan also gets fine-tuning windows, sized as `schedule` would
        size them: the fine-tuning scheduler advances its sequences when it plans them, so only
        a `previous` that ends sequences or steps an optimizer (what its update changes) stops
        the chain. Returns None, and leaves the step to `schedule`, whenever that shortcut could
        change what is computed: requests are waiting for admission, the KV cache would need a
        preemption, a row's sampling reads host state that `update` has not written yet
        (logprobs, penalties, per-step seeds, min_tokens still masking EOS), or the sharing
        policy alternates or splits phases. A request that finishes at `previous`'s update
        wastes its row in the new plan; `update` skips it (the request is no longer running),
        and the K/V the row writes lands in blocks the device reuses only for later steps.
        """
        rows = previous.sequences
        finetune = self.finetune.has_work()
        if (self.waiting or len(rows) != len(self.running) or previous.optimizer_steps
                or previous.finished_finetune_sequences or (finetune and not self.hybrid.plans_ahead)
                or not (rows or finetune)):
            return None
        for row, request in zip(rows, self.running):
            params = request.sampling_params
            if (row.request_id != request.request_id or not row.needs_sample
                    or request.num_computed_tokens != request.num_tokens
                    or request.num_tokens >= self.max_model_len
                    or params.logprobs is not None or params.prompt_logprobs is not None
                    or params.has_penalties or (not params.greedy and request.seed is not None)
                    or request.num_output_tokens < params.min_tokens):
                return None
        kv = self.kv_cache_manager
        for request in self.running:
            if not kv.allocate_lookahead(request, 1):
                return None  # blocks already taken stay with their requests for the next step
        plan = BatchPlan(continues_previous=bool(rows))
        for request in self.running:
            self._add_row(plan, request, 1, [PLACEHOLDER_TOKEN_ID])
        if finetune:
            mode = self.hybrid.mode(bool(self.running), True)
            self.hybrid.schedule_finetune(plan, self.finetune, mode, self.waiting)
            if plan.is_empty:  # fine-tuning waits for `previous`'s update
                return None
        plan.finished_request_ids = self.finished_request_ids
        self.finished_request_ids = []
        self.hybrid.finish_step(plan, 0)
        return plan

    def _schedule_running(self, plan: BatchPlan, budget: int) -> int:
        """Rows for the running requests, in admission order; preempts when blocks run out."""
        kv = self.kv_cache_manager
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new_tokens <= 0:  # scheduled but not yet updated (pipelined engines)
                index += 1
                continue
            while kv.allocate_slots(request, num_new_tokens) is None:
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break
            self._add_row(plan, request, num_new_tokens)
            budget -= num_new_tokens
            index += 1
        return budget

    def _admit_waiting(self, plan: BatchPlan, budget: int) -> int:
        """Admit waiting requests, the least-served tenant's earliest first (VTC, algorithm 4,
        lines 16-20; with one tenant this is FCFS).

        Admission is only reached once every running request got all its known tokens (a
        partial chunk uses up the budget), so no blocks are owed to half-done prompts and
        checking the whole prompt against the free blocks is exact.
        """
        kv = self.kv_cache_manager
        adapters = self.adapter_manager
        claimed: set[int] = set()  # adapters held back so a skipped request gets their slot
        queues: dict[str, deque[Request]] = {}  # tenant -> its waiting requests, in order
        if budget > 0 and len(self.running) < self.scheduler_config.max_num_seqs:
            for request in self.waiting:
                queues.setdefault(request.tenant, deque()).append(request)
        while (
            queues
            and budget > 0
            and len(self.running) < self.scheduler_config.max_num_seqs
        ):
            tenant = next(iter(queues)) if len(queues) == 1 else self.hybrid.pick_tenant(queues)
            queue = queues[tenant]
            request = queue.popleft()
            if not queue:
                del queues[tenant]
            lora_int_id = request.lora_int_id
            if lora_int_id and (lora_int_id in claimed or not adapters.can_pin(lora_int_id)):
                if lora_int_id not in claimed:
                    victim = adapters.drain_candidate(claimed)
                    if victim is not None:
                        claimed.add(victim)
                continue  # no slot for its adapter: let the requests behind it go first
            if request.sampling_params.prompt_logprobs is None:
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            else:  # prompt logprobs need every prompt position computed, not served from cache
                hit_blocks, num_hit_tokens = [], 0
            num_needed = kv.get_num_blocks_to_allocate(request, request.num_tokens, hit_blocks)
            if num_needed > kv.num_free_blocks:
                break  # nobody overtakes this request for KV blocks
            num_new_tokens = min(request.num_tokens - num_hit_tokens, budget)
            if kv.allocate_slots(request, num_new_tokens, hit_blocks) is None:
                break
            self.waiting.remove(request)
            if lora_int_id:
                slot, needs_load = adapters.pin(request.request_id, lora_int_id)
                if needs_load:
                    plan.lora_slot_loads[slot] = request.lora_request
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            first_admission = request.first_scheduled_time is None
            if first_admission:
                request.first_scheduled_time = self.clock()
                request.num_cached_tokens = num_hit_tokens
            # Prompt tokens are charged once; a recompute after preemption is not new service.
            self.hybrid.request_admitted(
                request, request.num_prompt_tokens if first_admission else 0)
            if kv.enable_prefix_caching:
                plan.num_new_prefix_cache_query_tokens += request.num_tokens
                plan.num_new_prefix_cache_hit_tokens += num_hit_tokens
            self._add_row(plan, request, num_new_tokens)
            budget -= num_new_tokens
        return budget

    def update(self, plan: BatchPlan, result: StepResult) -> list[Request]:
        """Append sampled tokens and check stops; returns the requests that got a token, in order.

        Rows of requests that ended between `schedule` and `update` (aborts) are skipped.
        """
        updated = []
        ended = set()
        for row in plan.sequences:
            request = self.requests.get(row.request_id)
            # The identity check catches an id that was aborted and reused before this update.
            if (
                request is None
                or request.status != RequestStatus.RUNNING
                or request.output_token_ids is not row.output_token_ids
                or not row.needs_sample
            ):
                continue
            token_id = result.sampled_token_ids[row.request_id]
            request.append_output_token_id(token_id)
            self.hybrid.tokens_generated(request)
            self._check_stop(request, token_id)
            if request.status.finished:
                self._free_request(request)
                ended.add(request.request_id)
            updated.append(request)
        if ended:
            self.running = [r for r in self.running if r.request_id not in ended]
        self.finetune.update(plan, result.finetune_losses, result.grad_norms,
                             result.finetune_errors)
        return updated

    def observe_iteration(self, plan: BatchPlan, seconds: float,
                          thread_seconds: float | None = None) -> None:
        """The measured time of an executed plan; corrects the latency model online.
        `thread_seconds`: the CPU time the engine thread spent on it (iteration traces)."""
        self.hybrid.observe(plan, seconds, thread_seconds)

    def observe_overhead(self, seconds: float) -> None:
        """Host time between two back-to-back iterations (see HybridTokenScheduler)."""
        self.hybrid.observe_overhead(seconds)

    # ------------------------------------------------------------------ state for the engine

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def has_finished_requests(self) -> bool:
        """Ids of ended requests are pending for the next plan (the worker drops their state)."""
        return bool(self.finished_request_ids)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests, in [0, 1]."""
        return self.kv_cache_manager.usage

    @property
    def num_prefix_cache_query_tokens(self) -> int:
        return self.kv_cache_manager.num_prefix_cache_query_tokens

    @property
    def num_prefix_cache_hit_tokens(self) -> int:
        return self.kv_cache_manager.num_prefix_cache_hit_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.kv_cache_manager.prefix_cache_hit_rate

    def reset_prefix_cache(self) -> int:
        return self.kv_cache_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ internals

    def _add_row(self, plan: BatchPlan, request: Request, num_new_tokens: int,
                 placeholders: list[int] | None = None) -> None:
        """`placeholders`: the row's tokens are not on the host yet (a continuation row, which
        always samples); otherwise they are the request's next known tokens."""
        start = request.num_computed_tokens
        end = start + num_new_tokens
        plan.sequences.append(ScheduledSequence(
            request_id=request.request_id,
            new_token_ids=request.all_token_ids[start:end] if placeholders is None else placeholders,
            num_computed_tokens=start,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            needs_sample=placeholders is not None or end == request.num_tokens,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_id=request.eos_token_id,
            seed=request.seed,
            lora_slot=(
                self.adapter_manager.slot_of(request.lora_int_id) if request.lora_int_id else -1
            ),
        ))
        plan.num_batched_tokens += num_new_tokens
        request.num_computed_tokens = end

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if self.adapter_manager is not None:
            self.adapter_manager.unpin(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)
        self.hybrid.request_queued(request)

    def _check_stop(self, request: Request, token_id: int) -> None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH

    def _free_request(self, request: Request) -> None:
        self.hybrid.num_completions += 1
        self.kv_cache_manager.free(request)
        if self.adapter_manager is not None:
            self.adapter_manager.finish_request(request.request_id)
        del self.requests[request.request_id]
        self.finished_request_ids.append(request.request_id)

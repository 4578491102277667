"""The fine-tuning half of the hybrid token scheduler: after the inference rows of a step, the
windows of fine-tuning jobs fill what the iteration has left (FlexLLM section 6.1, algorithm 2).

A job trains its optimizer steps in order. Jobs share bins: a round takes the current optimizer
step of every job between steps and packs the sequences of all of them into bins of at most
`FinetuneJobState.pack_capacity` tokens (`flexserve.finetune.packing.pack_round`: LobRA's length
buckets, then LoRAFusion's two-stage MILP with a greedy fallback). The sequences of a bin, of
whichever jobs, run concurrently, and the next bin starts once every sequence of this one has its
last window placed; the next round forms once every job of this one has its optimizer step folded
in. A job's bins hold only its current step, so its optimizer step still covers exactly its
batch, whatever ran beside it. Each sequence runs in two phases:

- forward: windows [l_i, l_i + s_i) in order, each one more row of the step's flat batch (same
  forward call as the inference rows, K/V into the paged cache); at most one per iteration,
  because the next window attends to this one's K/V;
- backward: from the iteration after its last forward window (the worker may run backward
  windows on a side stream, concurrently with the forward), layers from the top; inside a layer,
  windows [l_j - s_j, l_j) from the end of the sequence to the start (one iteration may hold
  several layer-windows, or a window may span iterations); each sequence keeps its own layer and
  window progress.

How many tokens a window gets is the `WindowSizer`'s answer (a plain token budget, or the hybrid
scheduler's latency model); which job gets the next window is the `JobPicker`'s (default: the job
that started first, `FirstStartedPicker`; the hybrid scheduler's picker charges tenants by VTC).

A bin's KV blocks are allocated in full when it starts (FlexLLM's admission rule: only if the
blocks of all its sequences, of every job, fit) and each sequence's blocks are freed after its last backward
window (layer 0, position 0) ran. Blocks are shared by all layers (one block id covers that block
in every layer's cache), so they are not released layer by layer. After a step's last bin, the
plan carries the job's optimizer step, and the job places nothing more until that step's result
is folded in (its next forward must see the updated adapter). Sequence ids are positions in the
job's training order (step by step), so packing, resuming and dropout seeds agree on them.

A DPO job (`FinetuneJobState.beta` set) trains pairs: its sequences are (chosen, rejected) sides,
a step's items are pairs and a bin holds both sides of each of its pairs. It starts with a
reference pass (its first round's items are all of its sequences): every side runs forward
windows under the reference adapter (the job's slot before its first optimizer step, or no
adapter when the job starts from PEFT's init, whose zero B makes the two equal), windows that
keep no activations and return the summed log-probability of the side's loss tokens (sequence
ids -1 - example index). Then each pair trains like two supervised sequences, except that a side
whose forward is done waits until its partner's is: the update that folds the second side's loss
computes the pair's coefficient (`flexserve.finetune.dpo`), and the plan of each side's first
backward window carries it as a factor on that side's loss gradient.
Pure Python: the worker owns every tensor (activations, gradients, optimizer state).

Divergence: the worker fails a job whose loss or gradient norm is not finite; the scheduler fails
one that has collapsed to a uniform prediction (`collapsed_reason`), whose finite loss would
otherwise let it "succeed" with an adapter that learned nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from flexserve.engine.divergence import collapsed_reason
from flexserve.engine.plan import BackwardWindow, BatchPlan, FinetuneSequenceStart, FinetuneWindow
from flexserve.finetune.checkpoint import FORMAT_VERSION, TrainerState, data_fingerprint
from flexserve.finetune.dpo import DPOMetrics, dpo_pair
from flexserve.finetune.packing import PackItem, load_solver, pack_jobs

# LobRA's interval width: bucket bounds at multiples of this many tokens (its default, 256)
BUCKET_INTERVAL = 256


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


@dataclass(slots=True)
class FinetuneUpdate:
    """Something a job did in the last step(s), for the service (events, metrics, checkpoints)."""

    job_id: str
    kind: str  # "step" (an optimizer step finished), "succeeded", "failed", "cancelled"
    step: int  # optimizer steps done after this update
    num_steps: int  # optimizer steps the job plans in all
    loss: float | None  # mean token loss of that step ("step" only)
    grad_norm: float | None  # its gradient norm before clipping ("step" only)
    num_trained_tokens: int  # forward tokens of the job so far (OpenAI's trained_tokens)
    message: str | None  # the failure reason, or the event text
    accuracy: float | None = None  # that step's mean token accuracy (argmax = target; "step")
    dpo: dict[str, float] | None = None  # a DPO step's `DPOMetrics.mean()` ("step")


class WindowSizer(Protocol):
    """How many tokens the next fine-tuning window may have in this iteration."""

    def forward(self, start: int, max_tokens: int) -> int:
        """Tokens (0..max_tokens) of a forward window starting at position `start` that fit in
        this iteration now; the sizer counts the returned tokens as taken."""
        ...

    def backward(self, end: int, max_tokens: int) -> int:
        """Tokens n (0..max_tokens) of a backward window [end - n, end) of one layer that fit
        now; counted as taken."""
        ...


class TokenBudgetSizer:
    """The plain token budget: a forward token and a backward token-layer both cost 1."""

    def __init__(self, budget: int) -> None:
        self._remaining = max(budget, 0)

    @property
    def remaining(self) -> int:
        return self._remaining

    def forward(self, start: int, max_tokens: int) -> int:
        return self._take(max_tokens)

    def backward(self, end: int, max_tokens: int) -> int:
        return self._take(max_tokens)

    def _take(self, max_tokens: int) -> int:
        n = max(0, min(max_tokens, self._remaining))
        self._remaining -= n
        return n


class JobPicker(Protocol):
    """Which job gets the next window of an iteration."""

    def pick(self, jobs: Sequence[FinetuneJobState]) -> FinetuneJobState:
        """Which of these jobs (all have schedulable work this step) gets the next window."""
        ...

    def charge(self, job: FinetuneJobState, num_tokens: int, backward: bool) -> None:
        """`num_tokens` of the job's window tokens were placed in the plan: forward-window
        tokens, or (`backward`) tokens of one layer's backward window."""
        ...


class FirstStartedPicker:
    """The default picker: the job that started first among the candidates (the scheduler
    passes candidates in start order), so a job's windows take what earlier jobs leave."""

    def pick(self, jobs: Sequence[FinetuneJobState]) -> FinetuneJobState:
        return jobs[0]

    def charge(self, job: FinetuneJobState, num_tokens: int, backward: bool) -> None:
        pass


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
    done: bool = False  # its last backward window is in a plan (blocks freed at that update)
    example_index: int = 0  # index into FinetuneJobState.sequences
    reference: bool = False  # a DPO reference sequence: forward windows only
    partner: int | None = None  # a DPO side: the sequence id of the other side of its pair
    chosen: bool = False  # a DPO side: the preferred one
    loss_sum: float = 0.0  # a DPO sequence: summed cross-entropy of its windows so far
    num_folded_tokens: int = 0  # a DPO sequence: positions whose window losses are in loss_sum
    grad_scale: float | None = None  # a DPO side: its factor, sent with its first backward window


@dataclass(slots=True)
class FinetuneJobState:
    """A job as the engine tracks it."""

    job_id: str
    sequences: list[TrainingSequence]  # the examples
    steps: list[list[int]]  # example indices of each optimizer step, in order
    lora_slot: int  # device slot holding the job's adapter for its whole run
    tenant: str = "default"  # the fair-share account its window tokens are charged to
    pack_capacity: int | None = None  # max tokens of a bin of concurrent sequences; None: its
    # sequences one per bin (beside other jobs' sequences)
    # Jobs whose forward windows may share an iteration have equal groups: the worker's CUDA
    # graph of an iteration writes one plan's activations (the engine groups jobs by LoRA rank,
    # targets and dropout, what the plan follows); None: no constraint.
    window_group: Hashable | None = None
    status: FinetuneJobStatus = FinetuneJobStatus.RUNNING
    error: str | None = None
    step_index: int = 0  # optimizer steps done
    # the job's share of the current round's bins (those holding any of its sequences, in round
    # order), each a list of (sequence id, example index); made with the round, dropped when its
    # optimizer step is folded in
    bins: list[list[tuple[int, int]]] | None = None
    next_bin: int = 0  # index into `bins` of the next bin to start
    running: list[_RunningSequence] = field(default_factory=list)  # holding KV blocks
    num_sequences_started: int = 0
    step_loss_sum: float = 0.0
    step_loss_count: int = 0
    step_num_correct: int = 0  # loss tokens of the current step predicted right (argmax)
    losses: list[float] = field(default_factory=list)  # mean token loss of each optimizer step
    grad_norms: list[float] = field(default_factory=list)  # pre-clip norm of each step
    num_forward_tokens: int = 0  # windows' tokens scheduled so far (metrics)
    num_backward_tokens: int = 0  # layer-window tokens of backward windows scheduled so far
    events: list[str] = field(default_factory=list)  # human-readable progress, oldest first
    slot_released: bool = False  # the engine gave its LoRA slot back after it ended
    data_sha256: str | None = None  # fingerprint of sequences and steps (made on first use)
    # DPO: beta (None: supervised); sequences are pairs (2i chosen, 2i + 1 rejected) and the
    # steps' indices are pair indices
    beta: float | None = None
    reference_slot: int = -1  # DPO: the slot of the reference windows (-1: the backbone alone)
    # DPO: summed log-probability of each sequence's loss tokens under the reference; None
    # until the reference pass is done
    reference_logprobs: list[float] | None = None
    reference_sums: list[float] = field(default_factory=list)  # DPO: the pass's results so far
    num_reference_tokens: int = 0  # DPO: tokens of reference windows scheduled so far
    dpo_step: DPOMetrics = field(default_factory=DPOMetrics)  # the current step's pairs
    dpo_metrics: list[dict[str, float]] = field(default_factory=list)  # each DPO step's means

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def finished(self) -> bool:
        return self.status != FinetuneJobStatus.RUNNING

    @property
    def in_reference_pass(self) -> bool:
        """A DPO job still computing its reference log-probabilities."""
        return self.beta is not None and self.reference_logprobs is None

    @property
    def sides(self) -> int:
        """Sequences per step item: 2 for a DPO pair, else 1."""
        return 1 if self.beta is None else 2

    @property
    def at_step_boundary(self) -> bool:
        """No sequence holds state: the job's adapter and optimizer are between steps."""
        return not self.running

    def fingerprint(self) -> str:
        if self.data_sha256 is None:
            self.data_sha256 = data_fingerprint(
                [(s.token_ids, s.loss_mask) for s in self.sequences], self.steps)
        return self.data_sha256


class FinetuneScheduler:
    """Places fine-tuning windows into plans; owns the engine-side state of every job."""

    def __init__(self, kv_cache_manager, num_layers: int, max_finetune_len: int,
                 vocab_size: int | None = None, packing_time_limit_s: float = 0.05,
                 max_length_buckets: int = 4, lockstep_jobs: bool = False) -> None:
        self.kv = kv_cache_manager
        self.num_layers = num_layers
        self.max_finetune_len = max_finetune_len
        self.vocab_size = vocab_size  # for `collapsed_reason`; None: not checked
        self.packing_time_limit_s = packing_time_limit_s  # a round's MILPs'; 0: greedy only
        self.max_length_buckets = max_length_buckets  # LobRA's R
        # The jobs of one window group go through their backward in lockstep together (the
        # worker runs their windows of a layer as one: batched backward)
        self.lockstep_jobs = lockstep_jobs
        self.jobs: dict[str, FinetuneJobState] = {}  # every job not yet removed, in start order
        self.default_picker = FirstStartedPicker()
        self._updates: list[FinetuneUpdate] = []
        # The current round's bins, each a list of (job id, sequence id, example index), and
        # the index of the next one to start
        self.round: list[list[tuple[str, int, int]]] = []
        self.next_bin = 0
        self.num_rounds = 0  # rounds formed so far (metrics, tests)
        self._plan_group: Hashable | None = None  # `schedule`'s plan's window group
        self.packing_methods: dict[str, int] = {"greedy": 0, "milp": 0}  # rounds by packer
        if packing_time_limit_s > 0:
            load_solver()

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
        if job.beta is not None:
            if len(job.sequences) % 2:
                raise ValueError("a DPO job's sequences are pairs: their number must be even")
            for i in range(0, len(job.sequences), 2):
                blocks = sum(-(-len(s.token_ids) // self.kv.block_size)
                             for s in job.sequences[i:i + 2])
                if blocks > self.kv.num_blocks:
                    raise ValueError(
                        f"pair {i // 2} has {blocks} KV blocks of tokens; both sides run at "
                        f"once and the KV cache holds {self.kv.num_blocks}")
        if job.pack_capacity is not None and job.pack_capacity < 1:
            raise ValueError(f"pack_capacity must be >= 1 or None, got {job.pack_capacity!r}")
        if job.beta is not None and not job.reference_sums:
            job.reference_sums = [0.0] * len(job.sequences)
        self.jobs[job.job_id] = job
        if job.step_index == job.num_steps and not job.finished:  # resumed after its last step
            job.status = FinetuneJobStatus.SUCCEEDED
            job.events.append("The job has successfully completed.")
            self._updates.append(self._update(job, "succeeded", job.events[-1]))

    def has_work(self) -> bool:
        return any(not job.finished for job in self.jobs.values())

    # ---------------------------------------------------------------------------- scheduling
    def schedule(self, plan: BatchPlan, sizer: WindowSizer, picker: JobPicker | None = None
                 ) -> None:
        """Add fine-tuning work to `plan`: start the round's next bin when the running one is
        done; ask `picker` for a job among those with schedulable work, place that job's next
        window as large as `sizer` allows, charge it; until the sizer gives no job a token or
        no job has work left (and no further bin may start)."""
        picker = picker or self.default_picker
        forwarded: set[tuple[str, int]] = set()  # sequences with a forward window in this plan
        self._plan_group = None  # set by the plan's first forward window of a grouped job
        progress = True
        while progress:
            progress = self._start_next_bin(plan)
            candidates = [job for job in self.jobs.values() if self._has_work(job, forwarded)]
            while candidates:
                job = picker.pick(candidates)
                num_tokens, backward, owner = self._place_window(plan, job, sizer, forwarded)
                if num_tokens > 0:
                    picker.charge(owner, num_tokens, backward)
                    progress = True
                if num_tokens == 0:
                    candidates = [c for c in candidates if c is not job]
                candidates = [c for c in candidates if self._has_work(c, forwarded)]

    def _has_work(self, job: FinetuneJobState, forwarded: set[tuple[str, int]]) -> bool:
        """Whether the job has a started sequence that may get a window in this plan."""
        if job.finished:
            return False
        return any(not s.done and (job.job_id, s.sequence_id) not in forwarded
                   for s in job.running)

    def _place_window(self, plan: BatchPlan, job: FinetuneJobState, sizer: WindowSizer,
                      forwarded: set[tuple[str, int]]
                      ) -> tuple[int, bool, FinetuneJobState]:
        """Place the job's next window (forward windows of its bin first, then backward ones:
        the job's, or another job's of its window group that is further behind); returns its
        tokens (0 when nothing could be placed: no KV blocks for its next bin, or the sizer
        said 0 to every window), whether it is a backward window and whose it is."""
        group = job.window_group
        if group is not None and job.in_reference_pass:
            group = ("reference",)  # a DPO reference pass keeps nothing: windows run eagerly
        other_group = (group is not None and self._plan_group is not None
                       and group != self._plan_group)
        for seq in job.running:
            key = (job.job_id, seq.sequence_id)
            if (other_group or seq.done or seq.backward_layer >= 0 or key in forwarded
                    or seq.num_forward_tokens == seq.length):
                continue
            n = sizer.forward(seq.num_forward_tokens, seq.length - seq.num_forward_tokens)
            if n <= 0:
                continue
            plan.finetune_windows.append(FinetuneWindow(
                job.job_id, seq.sequence_id, seq.num_forward_tokens,
                seq.num_forward_tokens + n,
                job.reference_slot if seq.reference else job.lora_slot))
            forwarded.add(key)
            if group is not None:
                self._plan_group = group
            seq.num_forward_tokens += n
            seq.kv.num_computed_tokens += n
            if seq.reference:
                job.num_reference_tokens += n
            else:
                job.num_forward_tokens += n
            plan.num_batched_tokens += n
            if seq.num_forward_tokens == seq.length:
                if seq.reference:  # nothing runs backward: its state goes at this update
                    seq.done = True
                    plan.finished_finetune_sequences.append(key)
                elif job.beta is None:
                    seq.backward_layer, seq.backward_end = self.num_layers - 1, seq.length
                # a DPO side waits for its pair's coefficient (`_start_pair_backward`)
            return n, False, job
        # Sequences in their backward move in lockstep: the one furthest behind (highest layer,
        # then most of its layer left) goes next, so windows of one layer on several sequences
        # follow each other in the plan and the worker runs them as one. With `lockstep_jobs`,
        # the jobs of one window group (one plan: their backward pieces are shared) move in
        # lockstep together, so the worker runs windows of several jobs as one too (MuxTune's
        # batched backward).
        jobs = [job] if (group is None or job.in_reference_pass
                         or not self.lockstep_jobs) else [
            j for j in self.jobs.values()
            if j.window_group == group and not j.finished and not j.in_reference_pass]
        order = {j.job_id: i for i, j in enumerate(jobs)}
        behind = sorted(((j, s) for j in jobs for s in j.running
                         if not s.done and s.backward_layer >= 0
                         and (j.job_id, s.sequence_id) not in forwarded),
                        key=lambda js: (-js[1].backward_layer, -js[1].backward_end,
                                        order[js[0].job_id]))
        for owner, seq in behind:
            n = sizer.backward(seq.backward_end, seq.backward_end)
            if n <= 0:
                continue
            if seq.grad_scale is not None:  # before its first backward window runs
                plan.finetune_grad_scales.append((owner.job_id, seq.sequence_id,
                                                  seq.grad_scale))
                seq.grad_scale = None
            plan.backward_windows.append(BackwardWindow(
                owner.job_id, seq.sequence_id, seq.backward_layer, seq.backward_end - n,
                seq.backward_end))
            owner.num_backward_tokens += n
            seq.backward_end -= n
            if seq.backward_end == 0:
                seq.backward_layer -= 1
                seq.backward_end = seq.length
            if seq.backward_layer < 0:  # its last window is in this plan
                seq.done = True
                plan.finished_finetune_sequences.append((owner.job_id, seq.sequence_id))
                if owner.next_bin == len(owner.bins) and all(s.done for s in owner.running):
                    plan.optimizer_steps.append(owner.job_id)
            return n, True, owner
        return 0, False, job

    # -------------------------------------------------------------------------------- rounds
    def _start_next_bin(self, plan: BatchPlan) -> bool:
        """Start the round's next bin (forming the next round first where the last one is
        over) when every running sequence has its last window placed; True when one started."""
        if any(not s.done for job in self.jobs.values() for s in job.running):
            return False
        while True:
            if self.next_bin == len(self.round) and not self._form_round():
                return False
            members = [(self.jobs[job_id], sequence_id, example_index)
                       for job_id, sequence_id, example_index in self.round[self.next_bin]
                       if job_id in self.jobs and not self.jobs[job_id].finished]
            if members:
                break
            self.next_bin += 1  # every job of this bin ended
        # Sequences whose last backward window is in this plan still hold their activations:
        # the bin starts beside them only where both fit max_finetune_len tokens, what the
        # worker reserves for activations (`flexserve.worker.finetune.activation_arena`).
        resident = sum(s.length for job in self.jobs.values() for s in job.running if s.done)
        tokens = sum(len(job.sequences[e].token_ids) for job, _, e in members)
        if resident and resident + tokens > self.max_finetune_len:
            return False
        started: list[tuple[FinetuneJobState, _RunningSequence]] = []
        for job, sequence_id, example_index in members:
            kv = _SequenceKV(f"finetune:{job.job_id}:{sequence_id}",
                             job.sequences[example_index].token_ids)
            if self.kv.allocate_slots(kv, kv.num_tokens, cache_blocks=False) is None:
                for _, seq in started:  # all of the bin or none of it
                    self.kv.free(seq.kv)
                return False  # its KV blocks do not fit now; inference keeps the memory
            started.append((job, _RunningSequence(
                sequence_id, kv, kv.num_tokens, example_index=example_index,
                reference=job.in_reference_pass)))
        for job in {id(job): job for job, _ in started}.values():
            self._start_sequences(plan, job, [seq for j, seq in started if j is job])
        self.next_bin += 1
        return True

    def _form_round(self) -> bool:
        """Pack the current step (a DPO job's reference pass: all of its sequences) of every job
        between steps into the next round's bins, once no job of the last round waits for its
        optimizer step to be folded in; False when there is no round to form."""
        jobs = [job for job in self.jobs.values() if not job.finished]
        if not jobs or any(job.bins is not None or job.running for job in jobs):
            return False
        entries: list[tuple[FinetuneJobState, list[tuple[int, int]], int, int]] = []
        for job in jobs:
            entries.extend((job, members, tokens, blocks)
                           for members, tokens, blocks in self._job_items(job))
        packing = pack_jobs([PackItem(job.job_id, tokens, blocks)
                             for job, _, tokens, blocks in entries],
                            {job.job_id: job.pack_capacity for job in jobs}, self.kv.num_blocks,
                            self.packing_time_limit_s, self.max_length_buckets, BUCKET_INTERVAL)
        self.packing_methods[packing.method] += 1
        bins = packing.bins
        self.round = []
        for job in jobs:
            job.bins, job.next_bin = [], 0
        for members in bins:
            round_bin = []
            per_job: dict[str, list[tuple[int, int]]] = {}
            for i in sorted(members):
                job, sequences = entries[i][0], entries[i][1]
                per_job.setdefault(job.job_id, []).extend(sequences)
                round_bin.extend((job.job_id, sid, e) for sid, e in sequences)
            for job_id, sequences in per_job.items():
                self.jobs[job_id].bins.append(sequences)
            self.round.append(round_bin)
        self.next_bin = 0
        self.num_rounds += 1
        return True

    def _job_items(self, job: FinetuneJobState) -> list[tuple[list[tuple[int, int]], int, int]]:
        """The job's items of its next round: (its sequences as (sequence id, example index),
        tokens, KV blocks). A DPO pair is one item of both sides' whole blocks, chosen first."""
        block = self.kv.block_size
        if job.in_reference_pass:
            return [([(-1 - i, i)], len(s.token_ids), -(-len(s.token_ids) // block))
                    for i, s in enumerate(job.sequences)]
        sides = job.sides
        first_id = job.num_sequences_started  # every earlier step's sequences started
        items = []
        for p, example in enumerate(job.steps[job.step_index]):
            sequences = [(first_id + sides * p + k, sides * example + k) for k in range(sides)]
            lengths = [len(job.sequences[e].token_ids) for _, e in sequences]
            blocks = sum(-(-n // block) for n in lengths)
            items.append((sequences, blocks * block if sides > 1 else lengths[0], blocks))
        return items

    def _start_sequences(self, plan: BatchPlan, job: FinetuneJobState,
                         started: list[_RunningSequence]) -> None:
        """The job's sequences of a starting bin (their KV blocks allocated) go into the plan."""
        reference = job.in_reference_pass
        if job.beta is None:
            num_loss_tokens = sum(sum(job.sequences[i].loss_mask)
                                  for i in job.steps[job.step_index])
            loss_scale = 1.0 / max(num_loss_tokens, 1)
        else:  # the pair's coefficient scales the gradient later (plan.finetune_grad_scales)
            loss_scale = 1.0
            if not reference:
                for chosen, rejected in zip(started[0::2], started[1::2]):
                    chosen.chosen = True
                    chosen.partner, rejected.partner = rejected.sequence_id, chosen.sequence_id
        for seq in started:
            example = job.sequences[seq.example_index]
            plan.finetune_starts.append(FinetuneSequenceStart(
                job.job_id, seq.sequence_id, example.token_ids, example.loss_mask,
                loss_scale=loss_scale, block_ids=self.kv.get_block_ids(seq.kv.request_id),
                reference=reference))
        if not reference:
            job.num_sequences_started += len(started)
        job.next_bin += 1
        job.running.extend(started)  # after the last bin's sequences, freed at their update

    # ------------------------------------------------------------------------------- results
    def update(self, plan: BatchPlan, losses: dict, grad_norms: dict[str, float],
               errors: dict[str, str]) -> list[FinetuneJobState]:
        """Fold a step's results in; returns the jobs whose state changed (for events)."""
        changed: dict[str, FinetuneJobState] = {}
        for (job_id, sequence_id), (loss_sum, count, num_correct) in losses.items():
            job = self.jobs.get(job_id)
            if job is not None:
                if job.beta is not None:
                    for seq in job.running:
                        if seq.sequence_id == sequence_id:
                            seq.loss_sum += loss_sum
                if sequence_id >= 0:
                    job.step_loss_sum += loss_sum
                    job.step_loss_count += count
                    job.step_num_correct += num_correct
                changed[job_id] = job
        for window in plan.finetune_windows:  # (a step planned ahead may have advanced
            # num_forward_tokens past what was folded in)
            job = self.jobs.get(window.job_id)
            if job is not None and job.beta is not None:
                for seq in job.running:
                    if seq.sequence_id == window.sequence_id:
                        seq.num_folded_tokens += window.end - window.start
        for job_id, sequence_id in plan.finished_finetune_sequences:
            job = self.jobs.get(job_id)
            if job is not None:
                for seq in job.running:
                    if seq.sequence_id == sequence_id:
                        self.kv.free(seq.kv)
                        if seq.reference:
                            job.reference_sums[seq.example_index] = -seq.loss_sum
                job.running = [s for s in job.running if s.sequence_id != sequence_id]
        for job in self.jobs.values():
            if job.beta is not None and not job.finished:
                self._advance_dpo(job)
        for job_id, reason in errors.items():
            job = self.jobs.get(job_id)
            if job is not None and not job.finished:
                self.end_job(job_id, FinetuneJobStatus.FAILED, reason)
                job.events.append(f"The job failed: {reason}")
                changed[job_id] = job
        for job_id in plan.optimizer_steps:
            job = self.jobs.get(job_id)
            if job is None or job.finished:
                continue
            dpo = None
            if job.beta is None:
                job.losses.append(job.step_loss_sum / max(job.step_loss_count, 1))
            else:
                dpo = job.dpo_step.mean()
                job.dpo_step = DPOMetrics()
                job.dpo_metrics.append(dpo)
                job.losses.append(dpo["loss"])
            job.grad_norms.append(grad_norms.get(job_id, float("nan")))
            job.events.append(f"Step {job.step_index + 1}/{job.num_steps}: training loss="
                              f"{job.losses[-1]:.4f}, grad norm={job.grad_norms[-1]:.4f}"
                              + ("" if dpo is None else
                                 f", reward margin={dpo['rewards/margin']:.4f}, preference "
                                 f"accuracy={dpo['rewards/accuracy']:.4f}"))
            accuracy = job.step_num_correct / max(job.step_loss_count, 1)
            job.step_loss_sum, job.step_loss_count, job.step_num_correct = 0.0, 0, 0
            job.step_index += 1
            job.bins, job.next_bin = None, 0
            self._updates.append(FinetuneUpdate(
                job_id, "step", job.step_index, job.num_steps, job.losses[-1],
                job.grad_norms[-1], job.num_forward_tokens, job.events[-1], accuracy, dpo))
            collapsed = collapsed_reason(job.losses, job.grad_norms, self.vocab_size)
            if collapsed is not None:
                self.end_job(job_id, FinetuneJobStatus.FAILED, collapsed)
                job.events.append(f"The job failed: {collapsed}")
            elif job.step_index == job.num_steps:
                job.status = FinetuneJobStatus.SUCCEEDED
                job.events.append("The job has successfully completed.")
                self._updates.append(self._update(job, "succeeded", job.events[-1]))
            changed[job_id] = job
        return list(changed.values())

    def _advance_dpo(self, job: FinetuneJobState) -> None:
        """After a DPO job's results are folded in: end its reference pass when every reference
        sequence is done; give each pair whose two forwards are done its coefficient and start
        both sides' backward."""
        if job.in_reference_pass:
            if job.bins is not None and job.next_bin == len(job.bins) and not job.running:
                job.reference_logprobs = list(job.reference_sums)
                job.bins, job.next_bin = None, 0
                job.events.append(f"Reference log-probabilities computed for "
                                  f"{len(job.sequences) // 2} pairs.")
            return
        num_pairs = len(job.steps[job.step_index]) if job.step_index < job.num_steps else 1
        by_id = {s.sequence_id: s for s in job.running}
        for chosen in job.running:
            rejected = by_id.get(chosen.partner) if chosen.chosen else None
            if (rejected is None or chosen.backward_layer >= 0 or chosen.done
                    or chosen.num_folded_tokens < chosen.length
                    or rejected.num_folded_tokens < rejected.length):
                continue
            ref = job.reference_logprobs
            pair = dpo_pair(job.beta, -chosen.loss_sum, -rejected.loss_sum,
                            ref[chosen.example_index], ref[rejected.example_index])
            job.dpo_step.add(pair)
            scale = pair.coefficient / num_pairs
            for seq, sign in ((chosen, 1.0), (rejected, -1.0)):
                seq.grad_scale = sign * scale
                seq.backward_layer, seq.backward_end = self.num_layers - 1, seq.length

    def end_job(self, job_id: str, status: FinetuneJobStatus, error: str | None = None) -> None:
        """Stop a job (cancel, failure): its sequences' KV blocks are freed now."""
        job = self.jobs[job_id]
        for seq in job.running:
            self.kv.free(seq.kv)
        job.running = []
        job.bins, job.next_bin = None, 0
        job.status = status
        job.error = error
        message = error if status == FinetuneJobStatus.FAILED else "Job cancelled."
        self._updates.append(self._update(job, status.value, message))

    def remove_job(self, job_id: str) -> None:
        job = self.jobs.pop(job_id, None)
        if job is not None:
            for seq in job.running:
                self.kv.free(seq.kv)
            job.running = []
        self._updates = [u for u in self._updates if u.job_id != job_id]

    def pop_updates(self) -> list[FinetuneUpdate]:
        """What jobs did since the last call, oldest first."""
        updates, self._updates = self._updates, []
        return updates

    @staticmethod
    def _update(job: FinetuneJobState, kind: str, message: str | None) -> FinetuneUpdate:
        return FinetuneUpdate(job.job_id, kind, job.step_index, job.num_steps, None, None,
                              job.num_forward_tokens, message)

    # ---------------------------------------------------------------------------- checkpoints
    def trainer_state(self, job_id: str) -> TrainerState:
        """The data position of a job between two optimizer steps (ValueError mid-step)."""
        job = self.jobs[job_id]
        if job.status == FinetuneJobStatus.FAILED:
            raise ValueError(f"fine-tuning job {job_id} failed; it has no state to checkpoint")
        if not job.at_step_boundary:
            raise ValueError(f"fine-tuning job {job_id} is inside optimizer step "
                             f"{job.step_index + 1}: checkpoint at a step boundary (after a "
                             "'step' update)")
        return TrainerState(
            job_id=job.job_id, step=job.step_index, num_steps=job.num_steps,
            num_sequences_started=job.num_sequences_started, losses=list(job.losses),
            grad_norms=list(job.grad_norms), num_forward_tokens=job.num_forward_tokens,
            num_backward_tokens=job.num_backward_tokens, data_sha256=job.fingerprint(),
            format_version=FORMAT_VERSION, reference_logprobs=(
                None if job.reference_logprobs is None else list(job.reference_logprobs)))

    @staticmethod
    def restore(job: FinetuneJobState, state: TrainerState) -> None:
        """Set a new (not yet added) job to continue where `state` stopped; ValueError when the
        checkpoint belongs to other data or another step plan."""
        if job.beta is not None:
            if state.reference_logprobs is None and state.step > 0:
                raise ValueError("the checkpoint has no reference log-probabilities: it is not "
                                 "a DPO job's")
            if (state.reference_logprobs is not None
                    and len(state.reference_logprobs) != len(job.sequences)):
                raise ValueError(f"the checkpoint has {len(state.reference_logprobs)} reference "
                                 f"log-probabilities for {len(job.sequences)} sequences")
            job.reference_logprobs = state.reference_logprobs
        elif state.reference_logprobs is not None:
            raise ValueError("the checkpoint is a DPO job's: resume it with method dpo")
        if state.num_steps != job.num_steps:
            raise ValueError(f"the checkpoint's job plans {state.num_steps} optimizer steps, this "
                             f"job {job.num_steps}: resume with the same data, batch_size and "
                             "n_epochs")
        if state.data_sha256 != job.fingerprint():
            raise ValueError("the checkpoint was trained on other examples or another step order "
                             "(data, max_seq_len, batch_size, n_epochs, shuffle and seed must "
                             "match)")
        expected = job.sides * sum(len(step) for step in job.steps[:state.step])
        if state.num_sequences_started != expected:
            raise ValueError(f"the checkpoint started {state.num_sequences_started} sequences in "
                             f"{state.step} steps; this job's steps hold {expected}")
        job.step_index = state.step
        job.num_sequences_started = state.num_sequences_started
        job.losses = list(state.losses)
        job.grad_norms = list(state.grad_norms)
        job.num_forward_tokens = state.num_forward_tokens
        job.num_backward_tokens = state.num_backward_tokens

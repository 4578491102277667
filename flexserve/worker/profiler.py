"""Times real iterations of a model runner on synthetic `BatchPlan`s, for the latency model.

`profile_executor` runs a `ProfileGrid` through `executor.execute(plan)` (which synchronizes the
device, so its wall time is the iteration's time):

- inference cases: prefill chunks (with and without cached context), decode batches at several
  context lengths, and both mixed;
- fine-tuning scenarios: a sequence of a profiling job (LoRA slot 0) goes through its forward
  windows in order, then the backward of its top `backward_layers` layers (windows end-to-start,
  `backward_group` windows per iteration, so an iteration may span layers), optionally with the
  same inference rows riding in every iteration and with the next run's forward windows sharing
  iterations with this run's backward; then it is dropped.

Everything runs in warmup + repeats rounds, each one pass over every case and scenario, so a
burst of noise hits one repeat of many shapes instead of every repeat of a few. Each timed plan's
`plan_shape` is its key: the first `warmup` times of a key are dropped (when more exist) and the
median of the rest is the sample. A held-out set of random cases from the grid's ranges is
measured in the same rounds and never fitted: the error report. Token ids are random and KV
contents are whatever the cache holds; neither changes an iteration's time. The executor must be
idle: the profiler owns its KV blocks and LoRA slot 0 while it runs.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, astuple, dataclass, field
from typing import Any

import torch

from flexserve.engine.latency_model import IterationShape, LatencyModel, plan_shape
from flexserve.engine.plan import (
    BackwardWindow,
    BatchPlan,
    FinetuneSequenceStart,
    FinetuneWindow,
    ScheduledSequence,
)
from flexserve.finetune.hyperparameters import Hyperparameters, LoRAHyperparameters
from flexserve.sampling_params import SamplingParams

PROFILE_JOB_ID = "flexserve-profile"
PROFILE_LORA_SLOT = 0


def device_name(device: torch.device | str) -> str:
    """What profiles are keyed by: the CUDA device's name, else the device type ("cpu")."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@dataclass(slots=True)
class ProfileResult:
    """What `profile_executor` measured."""

    samples: list[tuple[IterationShape, float]]  # grid iterations: (shape, median seconds)
    heldout: list[tuple[IterationShape, float]]  # random iterations, for the error report only
    num_iterations: int  # plans executed and timed (warmups and repeats included)
    seconds: float  # wall time of the whole profiling


@dataclass(slots=True)
class _Timings:
    """Measured seconds per shape key, in order of measurement."""

    warmup: int
    shapes: dict[tuple, IterationShape] = field(default_factory=dict)
    seconds: dict[tuple, list[float]] = field(default_factory=dict)

    def add(self, shape: IterationShape, seconds: float) -> None:
        key = astuple(shape)
        self.shapes.setdefault(key, shape)
        self.seconds.setdefault(key, []).append(seconds)

    def medians(self) -> list[tuple[IterationShape, float]]:
        out = []
        for key, times in self.seconds.items():
            kept = times[self.warmup:] if len(times) > self.warmup else times
            out.append((self.shapes[key], statistics.median(kept)))
        return out


# ------------------------------------------------------------------------------------ the grid
@dataclass(slots=True)
class InferenceCase:
    """The inference rows of one profiled iteration."""

    prefill: list[tuple[int, int]] = field(default_factory=list)  # (num_computed, num_new > 1)
    decode_rows: int = 0  # rows with one new token
    decode_context: int = 1  # keys each decode row reads (num_computed + 1)


@dataclass(slots=True)
class FinetuneScenario:
    """A profiling sequence: its forward windows, then the backward of its top layers."""

    num_tokens: int  # sequence length
    forward_window: int  # tokens per forward window (the last may be shorter)
    backward_window: int  # tokens per backward window (the one at the sequence start may be shorter)
    backward_group: int = 1  # backward windows per iteration; more than a layer has: several layers
    inference: InferenceCase = field(default_factory=InferenceCase)  # rows in every iteration
    overlap: bool = False  # the next repeat's forward windows share iterations with this backward
    backward_layers: int | None = None  # top layers whose backward is timed (None: all)


@dataclass(slots=True)
class ProfileGrid:
    """Which iterations `profile_executor` times, and the ranges its held-out cases come from."""

    inference: list[InferenceCase]  # inference-only iterations
    finetune: list[FinetuneScenario]  # fine-tuning sequences (with inference rows riding along)
    max_tokens: int  # forward tokens of one iteration at most (the scheduler's token budget)
    max_context: int  # positions at most (max_model_len)
    max_rows: int  # decode rows at most (max_num_seqs)
    max_finetune_len: int  # the longest profiling sequence
    num_heldout_inference: int = 6  # random inference iterations held out of the fit
    num_heldout_finetune: int = 1  # random fine-tuning scenarios held out of the fit
    seed: int = 0  # token ids and held-out draws

    @classmethod
    def default(cls, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int,
                max_finetune_len: int, quick: bool = False) -> ProfileGrid:
        """The grid `flexserve profile` runs, within the engine's limits. `quick` fits a CPU
        (about a minute for SmolLM2-135M in fp32); the full grid is meant for GPUs."""
        m = min(max_num_batched_tokens, 256 if quick else 8192)  # tokens per iteration
        c = min(max_model_len, 1024 if quick else 16384)  # context
        r = min(max_num_seqs, 32 if quick else 256)  # decode rows
        n = min(max_finetune_len, max_model_len, m, 128 if quick else 2048)  # sequence length
        if min(m, c, n) < 16:
            raise ValueError("profiling needs a token budget, context and fine-tuning length of "
                             "at least 16 tokens")
        prefill = {16, 64, m // 2, m} if quick else set(_powers(16, m))
        inference = [InferenceCase([(0, k)]) for k in sorted(prefill)]
        inference += [InferenceCase([(ctx - k, k)]) for k in sorted({m // 16, m // 4})
                      for ctx in sorted({c // 2, c}) if ctx > k >= 2]
        rows = {1, 4, r // 2, r} if quick else set(_powers(1, r))
        contexts = {32, c // 2} if quick else {128, 1024, c // 4, c}
        inference += [InferenceCase(decode_rows=k, decode_context=ctx)
                      for k in sorted(rows - {0}) for ctx in sorted(contexts) if ctx <= c]
        inference += [InferenceCase([(0, p)], k, c // 4)
                      for p in sorted({m // 8, m // 2}) for k in sorted({max(1, r // 8), r // 2})
                      if k >= 1 and p >= 2 and p + k <= m]
        seq = FinetuneScenario
        # Backward over a few top layers: every layer costs the same (the bottom one a little
        # less: no input gradient), and the repeats come from the runs.
        finetune = [
            seq(n, n // 4, n // 4, backward_layers=2),
            seq(n, n // 2, n, 2, InferenceCase(decode_rows=max(1, r // 4), decode_context=c // 4),
                backward_layers=4),
            seq(n // 2, n // 8, n // 8, 4, InferenceCase([(0, m // 8)]), overlap=True,
                backward_layers=2),
        ]
        if not quick:
            finetune += [
                seq(n, n // 32, n // 16),
                seq(n, n // 2, n // 4, 1, InferenceCase([(c // 2, m // 4)], r // 8, c // 2),
                    backward_layers=4),
                seq(n // 4, n // 8, n // 4, 8, InferenceCase(decode_rows=r // 2,
                                                             decode_context=c // 8), True, 8),
            ]
        finetune = [s for s in finetune
                    if min(s.num_tokens, s.forward_window, s.backward_window) >= 1]
        return cls(inference, finetune, m, c, r, n,
                   num_heldout_inference=6 if quick else 24,
                   num_heldout_finetune=1 if quick else 3)

    def heldout_cases(self) -> tuple[list[InferenceCase], list[FinetuneScenario]]:
        """Random cases from the grid's ranges (seeded): log-uniform sizes, random mixes."""
        rng = random.Random(self.seed + 1)
        inference = [self._random_inference(rng, self.max_tokens)
                     for _ in range(self.num_heldout_inference)]
        finetune = []
        for _ in range(self.num_heldout_finetune):
            n = _log_uniform(rng, min(64, self.max_finetune_len), self.max_finetune_len)
            forward = _log_uniform(rng, min(16, n), n)
            backward = _log_uniform(rng, min(16, n), n)
            per_layer = -(-n // backward)
            rows = (self._random_inference(rng, self.max_tokens - forward)
                    if rng.random() < 0.7 and forward < self.max_tokens else InferenceCase())
            finetune.append(FinetuneScenario(
                n, forward, backward, rng.choice([1, 2, per_layer, 2 * per_layer]), rows,
                overlap=rng.random() < 0.5, backward_layers=2))
        return inference, finetune

    def _random_inference(self, rng: random.Random, max_tokens: int) -> InferenceCase:
        case = InferenceCase()
        budget = max_tokens
        if rng.random() < 0.6 and budget >= 2:
            num_new = _log_uniform(rng, 2, min(budget, self.max_context))
            num_computed = 0 if rng.random() < 0.5 else rng.randrange(
                self.max_context - num_new + 1)
            case.prefill.append((num_computed, num_new))
            budget -= num_new
        if budget >= 1 and (not case.prefill or rng.random() < 0.6):
            case.decode_rows = _log_uniform(rng, 1, min(budget, self.max_rows))
            case.decode_context = _log_uniform(rng, 16, self.max_context)
        return case

    def to_dict(self) -> dict:
        """JSON-ready (profile metadata)."""
        return asdict(self)


def _powers(lo: int, hi: int) -> list[int]:
    out, k = [], lo
    while k < hi:
        out.append(k)
        k *= 2
    return out + [hi]


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An int in [lo, hi], uniform in log space."""
    if hi <= lo:
        return lo
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


# ------------------------------------------------------------------------------- running it
@dataclass(slots=True)
class _Drop:
    """Work item: drop the sequence's state after this iteration (an untimed plan)."""

    sequence_id: int


class _Profiler:
    """Builds the plans of cases and scenarios, round by round, and times them."""

    def __init__(self, executor: Any, info: Any, scenarios: list[FinetuneScenario],
                 num_runs: int, seed: int, clock: Callable[[], float]) -> None:
        self.executor = executor
        self.clock = clock
        self.block_size = info.block_size
        self.vocab_size = info.vocab_size
        self.num_layers = info.num_layers
        self.num_runs = num_runs
        self.rng = random.Random(seed)
        self.params = SamplingParams()
        self.sequence_ids = itertools.count()
        # Each scenario owns room for two sequences (overlap keeps two alive, and a scenario's
        # sequence may stay alive while others run); inference rows take the rest of the
        # blocks, round robin (rows share blocks when they run out).
        self.first_block = {}
        num_blocks = 0
        for i, scenario in enumerate(scenarios):
            self.first_block[i] = num_blocks
            num_blocks += 2 * -(-scenario.num_tokens // self.block_size)
        self.finetune_blocks = num_blocks
        self.num_inference_blocks = info.num_blocks - num_blocks
        if self.num_inference_blocks < 1:
            raise ValueError(f"the KV cache ({info.num_blocks} blocks) cannot hold the profiling "
                             f"sequences ({num_blocks} blocks); give it more memory")
        self.next_block = 0
        self.num_iterations = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab_size) for _ in range(n)]

    def _blocks(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // self.block_size)
        first = self.next_block
        self.next_block = (first + count) % self.num_inference_blocks
        return [self.finetune_blocks + (first + i) % self.num_inference_blocks
                for i in range(count)]

    def _row(self, index: int, num_computed: int, num_new: int) -> ScheduledSequence:
        tokens = self._tokens(num_new)
        return ScheduledSequence(
            request_id=f"profile-{index}", new_token_ids=tokens, num_computed_tokens=num_computed,
            block_ids=self._blocks(num_computed + num_new), needs_sample=True,
            sampling_params=self.params, prompt_token_ids=tokens, output_token_ids=[],
            eos_token_id=None, seed=None)

    def inference_rows(self, case: InferenceCase) -> list[ScheduledSequence]:
        rows = [self._row(i, c, n) for i, (c, n) in enumerate(case.prefill)]
        rows += [self._row(len(rows) + i, case.decode_context - 1, 1)
                 for i in range(case.decode_rows)]
        return rows

    def case_rounds(self, case: InferenceCase) -> list[list[tuple[BatchPlan, bool]]]:
        """Per run: [(the case's plan, timed)]."""
        plan = BatchPlan(sequences=self.inference_rows(case))
        return [[(plan, True)] for _ in range(self.num_runs)]

    def scenario_rounds(self, index: int,
                        scenario: FinetuneScenario) -> list[list[tuple[BatchPlan, bool]]]:
        """Per run: the (plan, timed) pairs of one pass of the scenario's sequence. With overlap,
        run r's backward windows share iterations with the forward windows of the sequence of
        run r + 1 (so there is one more sequence; the first one's forward alone is untimed, the
        last one has no backward). A sequence is dropped by an untimed plan after its last work."""
        rows = self.inference_rows(scenario.inference)
        if scenario.overlap:
            runs = [self._sequence_work(index, scenario, r) for r in range(self.num_runs + 1)]
            runs[-1][0][-1].append(_Drop(runs[-1][2]))
            rounds = [[(f + b, True) for b, f in itertools.zip_longest(
                backward, forward, fillvalue=[])]
                for (_, backward, _), (forward, _, _) in zip(runs, runs[1:])]
            rounds[0][:0] = [(items, False) for items in runs[0][0]]
        else:
            runs = [self._sequence_work(index, scenario, r) for r in range(self.num_runs)]
            rounds = [[(items, True) for items in forward + backward]
                      for forward, backward, _ in runs]
        return [[plan for items, timed in work for plan in _plans_of(rows, items, timed)]
                for work in rounds]

    def _sequence_work(self, index: int, scenario: FinetuneScenario,
                       run: int) -> tuple[list, list, int]:
        """(forward items per iteration, backward items per iteration, sequence id) of one run;
        the last backward iteration carries the sequence's drop."""
        sequence_id = next(self.sequence_ids)
        n = scenario.num_tokens
        num_blocks = -(-n // self.block_size)
        first = self.first_block[index] + (run % 2) * num_blocks
        start = FinetuneSequenceStart(
            PROFILE_JOB_ID, sequence_id, self._tokens(n), [False] + [True] * (n - 1),
            1.0 / max(1, n - 1), list(range(first, first + num_blocks)))
        forward = []
        for begin in range(0, n, scenario.forward_window):
            end = min(n, begin + scenario.forward_window)
            window = FinetuneWindow(PROFILE_JOB_ID, sequence_id, begin, end, PROFILE_LORA_SLOT)
            forward.append([start, window] if begin == 0 else [window])
        w = scenario.backward_window
        num_layers = min(self.num_layers, scenario.backward_layers or self.num_layers)
        windows = [BackwardWindow(PROFILE_JOB_ID, sequence_id, layer, max(0, end - w), end)
                   for layer in range(self.num_layers - 1, self.num_layers - 1 - num_layers, -1)
                   for end in range(n, 0, -w)]
        group = scenario.backward_group
        backward = [windows[i:i + group] for i in range(0, len(windows), group)]
        backward[-1].append(_Drop(sequence_id))
        return forward, backward, sequence_id

    def time_plan(self, plan: BatchPlan, timings: _Timings | None) -> None:
        start = self.clock()
        result = self.executor.execute(plan)
        seconds = self.clock() - start
        if result.finetune_errors:
            raise RuntimeError(f"the profiling job failed: {result.finetune_errors}")
        if timings is not None:
            self.num_iterations += 1
            timings.add(plan_shape(plan), seconds)


def _plans_of(rows: list[ScheduledSequence], items: list[Any],
              timed: bool) -> list[tuple[BatchPlan, bool]]:
    """One iteration's plan from its work items (+ an untimed plan dropping finished ones)."""
    plan = BatchPlan(sequences=rows)
    for item in items:
        if isinstance(item, FinetuneSequenceStart):
            plan.finetune_starts.append(item)
        elif isinstance(item, FinetuneWindow):
            plan.finetune_windows.append(item)
        elif isinstance(item, BackwardWindow):
            plan.backward_windows.append(item)
    done = [(PROFILE_JOB_ID, item.sequence_id) for item in items if isinstance(item, _Drop)]
    if not done:
        return [(plan, timed)]
    return [(plan, timed), (BatchPlan(finished_finetune_sequences=done), False)]


def profile_executor(executor: Any, info: Any, grid: ProfileGrid, repeats: int = 3,
                     warmup: int = 1, progress: bool = True,
                     clock: Callable[[], float] = time.perf_counter) -> ProfileResult:
    """Time the grid's iterations (and its held-out set) on `executor`, an idle `ModelRunner`
    with LoRA enabled; `info` is its `ModelInfo`. Returns per-shape medians of `repeats` times
    after `warmup`; the profiling job is removed afterwards. `clock` times an iteration: wall
    time, which is what the engine observes (`time.thread_time` measures a single-threaded CPU
    executor without the other processes that share its cores).

    Everything runs in warmup + repeats rounds, each round one pass over every case and scenario
    (held-out ones too), so a burst of noise (another process, a clock change) hits one repeat of
    many shapes rather than every repeat of a few."""
    from tqdm import tqdm

    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if getattr(executor, "lora_manager", None) is None:
        raise ValueError("profiling fine-tuning iterations needs LoRA slots: enable LoRA")
    heldout_inference, heldout_finetune = grid.heldout_cases()
    _check_grid(grid.inference + heldout_inference, grid.finetune + heldout_finetune, info)
    began = time.perf_counter()
    scenarios = grid.finetune + heldout_finetune
    prof = _Profiler(executor, info, scenarios, warmup + repeats, grid.seed, clock)
    train, heldout = _Timings(warmup), _Timings(warmup)
    units = []  # (rounds, where the times go)
    for cases, timings in ((grid.inference, train), (heldout_inference, heldout)):
        units += [(prof.case_rounds(case), timings) for case in cases]
    for i, scenario in enumerate(scenarios):
        units.append((prof.scenario_rounds(i, scenario),
                      train if i < len(grid.finetune) else heldout))
    rank = min(16, executor.config.lora.max_lora_rank)
    executor.add_finetune_job(
        job_id=PROFILE_JOB_ID, lora_slot=PROFILE_LORA_SLOT,
        hyperparameters=Hyperparameters(lora=LoRAHyperparameters(r=rank, alpha=2.0 * rank)),
        num_training_steps=1, init_adapter_path=None, seed=grid.seed)
    try:
        total = sum(timed for rounds, _ in units for work in rounds for _, timed in work)
        with tqdm(total=total, desc="profiling", unit="iter", disable=not progress,
                  dynamic_ncols=True) as bar:
            for r in range(prof.num_runs):
                bar.set_postfix_str(f"round {r + 1}/{prof.num_runs}")
                for rounds, timings in units:
                    for plan, timed in rounds[r]:
                        prof.time_plan(plan, timings if timed else None)
                        bar.update(timed)
    finally:
        executor.remove_finetune_job(PROFILE_JOB_ID)
    return ProfileResult(train.medians(), heldout.medians(), prof.num_iterations,
                         time.perf_counter() - began)


def _check_grid(cases: list[InferenceCase], scenarios: list[FinetuneScenario],
                info: Any) -> None:
    """ValueError for a case the model or the cache cannot run."""
    for case in cases + [s.inference for s in scenarios]:
        for num_computed, num_new in case.prefill:
            if num_new < 2 or num_computed < 0 or num_computed + num_new > info.max_model_len:
                raise ValueError(f"prefill row ({num_computed}, {num_new}) is not a chunk of 2+ "
                                 f"tokens within max_model_len {info.max_model_len}")
        if case.decode_rows < 0 or not 1 <= case.decode_context <= info.max_model_len:
            raise ValueError(f"decode context {case.decode_context} is not in "
                             f"[1, {info.max_model_len}]")
    for s in scenarios:
        if not (2 <= s.num_tokens <= info.max_model_len and s.forward_window >= 1
                and s.backward_window >= 1 and s.backward_group >= 1):
            raise ValueError(f"bad fine-tuning scenario {s}: 2 <= num_tokens <= "
                             f"{info.max_model_len}, windows and group >= 1")


def fit_profile(result: ProfileResult, metadata: dict | None = None) -> LatencyModel:
    """Fit the latency model on the grid's samples; its metadata gets both error reports
    ("fit" on the grid, "heldout" on the held-out iterations, whose median is also
    "median_rel_error") and the profiling's size."""
    model = LatencyModel.fit(result.samples, metadata)
    model.metadata["heldout"] = model.evaluate(result.heldout)
    model.metadata["median_rel_error"] = model.metadata["heldout"]["median_rel_error"]
    model.metadata["num_iterations"] = result.num_iterations
    model.metadata["profile_seconds"] = round(result.seconds, 3)
    return model

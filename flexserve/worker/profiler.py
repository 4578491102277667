"""Times real iterations of a model runner on synthetic `BatchPlan`s, for the latency model.

`profile_executor` runs a `ProfileGrid` (`flexserve.worker.profile_grid`) through
`executor.execute(plan)` (which synchronizes the device, so its wall time is the iteration's time):

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
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, field
from typing import Any

import torch

from flexserve.engine.iteration_shape import SHAPE_FIELDS, IterationShape, plan_shape
from flexserve.engine.latency_model import LatencyModel
from flexserve.engine.plan import (
    BackwardWindow,
    BatchPlan,
    FinetuneSequenceStart,
    FinetuneWindow,
    ScheduledSequence,
)
from flexserve.finetune.hyperparameters import Hyperparameters, LoRAHyperparameters
from flexserve.sampling_params import SamplingParams
from flexserve.worker.profile_grid import FinetuneScenario, InferenceCase, ProfileGrid

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
                     clock: Callable[[], float] = time.perf_counter,
                     target_modules: list[str] | None = None, lora_dropout: float = 0.0,
                     max_lora_rank: int | None = None) -> ProfileResult:
    """Time the grid's iterations (and its held-out set) on `executor`, an idle `ModelRunner`
    with LoRA enabled or the executor of tensor-parallel ranks (`max_lora_rank` given: its
    slots' rank); `info` is its `ModelInfo`. Returns per-shape medians of `repeats` times
    after `warmup`; the profiling job is removed afterwards. `clock` times an iteration: wall
    time, which is what the engine observes (`time.thread_time` measures a single-threaded CPU
    executor without the other processes that share its cores). The profiling job trains a
    rank-16 (or the slots' largest rank below) LoRA on `target_modules` (all seven projections by
    default) with dropout `lora_dropout`.

    Everything runs in warmup + repeats rounds, each round one pass over every case and scenario
    (held-out ones too), so a burst of noise (another process, a clock change) hits one repeat of
    many shapes rather than every repeat of a few."""
    from tqdm import tqdm

    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if max_lora_rank is None:
        if getattr(executor, "lora_manager", None) is None:
            raise ValueError("profiling fine-tuning iterations needs LoRA slots: drop "
                             "--no-enable-lora")
        max_lora_rank = executor.config.lora.max_lora_rank
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
    rank = min(16, max_lora_rank)
    executor.add_finetune_job(
        job_id=PROFILE_JOB_ID, lora_slot=PROFILE_LORA_SLOT,
        hyperparameters=Hyperparameters(lora=LoRAHyperparameters(
            r=rank, alpha=2.0 * rank, dropout=lora_dropout,
            **({} if target_modules is None else {"target_modules": list(target_modules)}))),
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
    # The measurements themselves, so a profile can be refitted or studied off the device.
    model.metadata["samples"] = {
        "fields": [*SHAPE_FIELDS, "seconds"],
        "grid": [[*astuple(shape), seconds] for shape, seconds in result.samples],
        "heldout": [[*astuple(shape), seconds] for shape, seconds in result.heldout]}
    return model


def recorded_samples(model: LatencyModel
                     ) -> tuple[list[tuple[IterationShape, float]], list[tuple[IterationShape,
                                                                                float]]]:
    """The (grid, held-out) measurements a profile was fitted and checked on (`fit_profile`);
    ValueError for a profile that did not record them."""
    recorded = model.metadata.get("samples")
    if not isinstance(recorded, dict) or recorded.get("fields") != [*SHAPE_FIELDS, "seconds"]:
        raise ValueError("this latency profile has no recorded samples of this version")
    return tuple([(IterationShape(*row[:-1]), float(row[-1])) for row in recorded[kind]]
                 for kind in ("grid", "heldout"))  # type: ignore[return-value]

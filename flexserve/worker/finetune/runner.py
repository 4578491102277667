"""The worker side of token-level fine-tuning: each job's adapter, optimizer and pruning plan, and
each running sequence's activation store and layer-wise backward (FlexLLM 5.2, 6.1).

The model runner calls, per step: `start_sequences` (plan.finetune_starts), `capture_windows`
before the shared forward (so the model's layers hand the windows' tensors to their stores),
`window_losses` after it, then `run_backward` (plan.backward_windows), `read_losses` (every
window's loss, queued on the device until then, copied to the host at once), `optimizer_steps`
and `finish_sequences`; `reference_logprobs` after the forward when the plan has DPO reference
windows (sequences started with `reference`: no activation store, no backward, only the summed
log-probability of their loss tokens), and `run_backward` first scales the loss gradient of the
sequences in `plan.finetune_grad_scales` (a DPO pair's coefficient). A job's adapter lives in
one LoRA slot for the job's whole run, in the model's dtype, copied from the fp32 master weights
after every optimizer step. A failing job is reported in the step result and dropped; the server
and other jobs go on. Any exception inside one job's
work fails that job alone: a non-finite window loss or gradient norm (the job diverged), running
out of device memory (its activations are dropped and the allocator's cache emptied, so
inference and the other jobs get the memory back), or a bug. `inject_fault` poisons a job's next
piece of work on purpose, for tests and fire drills.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flexserve.engine.plan import BackwardWindow, FinetuneSequenceStart, FinetuneWindow
from flexserve.finetune.checkpoint import (
    TRAINER_STATE_NAME,
    commit_directory,
    write_json,
    write_optimizer_state,
)
from flexserve.finetune.hyperparameters import Hyperparameters
from flexserve.finetune.optimizer import AdapterOptimizer
from flexserve.layers.device_copy import HostCopy
from flexserve.peft.activation_budget import LayerPlans, budget_bytes_from_gib, plan_layers
from flexserve.peft.bypass import TARGET_MODULES, target_shapes
from flexserve.peft.graph_pruning import PruningPlan
from flexserve.peft.layer_graph import LayerGraph, build_layer_graph
from flexserve.peft.lora import LoRAAdapter, lora_scaling
from flexserve.peft.peft_io import save_peft_adapter
from flexserve.worker.finetune.activation_arena import ActivationArena
from flexserve.worker.finetune.activation_store import (
    ActivationStore,
    FinetuneCapture,
    store_layout,
)
from flexserve.worker.finetune.backward_graphs import (
    BackwardBuffers,
    BackwardGraphs,
    backward_buckets,
)
from flexserve.worker.finetune.graph_capture import UNSUPPORTED_SUFFIXES, KeptTensor
from flexserve.worker.finetune.layer_backward import SequenceBackward, lora_grad_name
from flexserve.worker.finetune.sharded_adapter import ShardedAdapter
from flexserve.worker.finetune.window_loss import (
    PendingWindowLoss,
    SequenceTargets,
    copy_window_losses,
    window_logprob_sum_async,
    window_loss_async,
)

logger = logging.getLogger(__name__)

FAULT_KINDS = ("nan_loss", "nan_grad", "oom")  # what `FinetuneRunner.inject_fault` can poison


@dataclass(slots=True)
class FinetuneJobSpec:
    """What the worker needs to run a job (the engine builds it from the job's request)."""

    job_id: str
    lora_slot: int  # the device slot reserved for the job's adapter
    hyperparameters: Hyperparameters
    num_training_steps: int
    init_adapter: LoRAAdapter | None = None  # start from these weights (else PEFT's init)
    seed: int = 0  # adapter init and dropout masks
    # resume: (tensors, config) of `AdapterOptimizer.checkpoint_state()` from a checkpoint whose
    # adapter is `init_adapter`; its rank, alpha and targets must be the hyper-parameters'
    resume_state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None


@dataclass(slots=True)
class _Sequence:
    start: FinetuneSequenceStart
    store: ActivationStore | None  # None: a reference sequence (forward only, nothing kept)
    backward: SequenceBackward | None
    targets: SequenceTargets | None = None  # its counted targets, found at its first window

    def window_targets(self, device: torch.device) -> SequenceTargets:
        if self.targets is None:
            self.targets = SequenceTargets(self.start.token_ids, self.start.loss_mask, device)
        return self.targets


class _Job:
    """One job's adapter, optimizer and plan on the device."""

    def __init__(self, spec: FinetuneJobSpec, model: Any, hf_config: Any, device: torch.device,
                 dtype: torch.dtype, remat_threshold: float | None, remat_chains: bool = False,
                 activation_budget_gib: float | None = None,
                 max_finetune_len: int | None = None, activation_offload: bool = False) -> None:
        lora = spec.hyperparameters.lora
        self.spec = spec
        if spec.init_adapter is not None:
            adapter = spec.init_adapter
            rank, alpha, rslora = adapter.rank, adapter.lora_alpha, adapter.use_rslora
            targets = adapter.target_modules
            if spec.resume_state is not None and (
                    (rank, alpha, set(targets)) != (lora.r, lora.alpha, set(lora.target_modules))):
                raise ValueError(
                    f"the checkpoint's adapter (r={rank}, alpha={alpha}, targets "
                    f"{sorted(targets)}) does not match the job's LoRA settings (r={lora.r}, "
                    f"alpha={lora.alpha}, targets {sorted(lora.target_modules)})")
            if set(targets) != set(lora.target_modules):
                logger.info("job %s: init_adapter targets %s (not %s)", spec.job_id,
                            list(targets), lora.target_modules)
        else:
            rank, alpha, rslora, targets = lora.r, lora.alpha, False, tuple(lora.target_modules)
            adapter = LoRAAdapter.create(
                target_shapes(hf_config), hf_config.num_hidden_layers, rank, alpha, targets,
                generator=torch.Generator().manual_seed(spec.seed))
        self.rank, self.lora_alpha, self.use_rslora = rank, alpha, rslora
        self.scaling = lora_scaling(rank, alpha, rslora)
        self.dropout = lora.dropout
        # Under tensor parallelism this rank trains its part of each tensor (`ShardedAdapter`),
        # and its layer graph has its heads and features.
        layout = getattr(model, "layout", None)
        self.sharded: ShardedAdapter | None = None
        if layout is not None and layout.world_size > 1:
            shapes = target_shapes(hf_config)
            self.sharded = ShardedAdapter(layout, model.tp, {
                lora_grad_name(layer, target, half): (target, half, (
                    (rank, shapes[target][0]) if half == "A" else (shapes[target][1], rank)))
                for layer, target in adapter.weights for half in ("A", "B")})
            hf_config = layout.local_config(hf_config)
        self.graph: LayerGraph = build_layer_graph(
            hf_config, {t: "lora" for t in targets}, rank=rank, dropout=lora.dropout)
        element = torch.empty((), dtype=dtype).element_size()
        # One plan per layer (layer 0's without its input gradient), mixed with remat chains to
        # fit the activation budget at the job's longest possible sequence: its data are cut
        # to max_seq_len and to max_finetune_len.
        max_num_tokens = spec.hyperparameters.max_seq_len
        if max_finetune_len is not None:
            max_num_tokens = min(max_num_tokens, max_finetune_len)
        self.layer_plans: LayerPlans = plan_layers(
            self.graph, element, hf_config.num_hidden_layers, remat_threshold, remat_chains,
            budget_bytes_from_gib(activation_budget_gib), max_num_tokens,
            offload=activation_offload)
        self.plan: PruningPlan = self.layer_plans.plans[-1]  # the top layer's (lean if all are)
        params = {}
        for (layer, target), pair in adapter.weights.items():
            for half, whole in zip("AB", pair):
                name = lora_grad_name(layer, target, half)
                params[name] = self._shard(name, whole).to(device=device, dtype=torch.float32)
        self.keys = sorted(adapter.weights)
        self.optimizer = AdapterOptimizer.from_hyperparameters(
            params, spec.hyperparameters, spec.num_training_steps)
        if spec.resume_state is not None:
            tensors, config = spec.resume_state
            self.optimizer.load_checkpoint_state(
                {key: self._shard(key.rsplit(".", 1)[0], t) for key, t in tensors.items()},
                config)
        self.model = model
        self.sequences: dict[int, _Sequence] = {}
        self.backward_graphs: BackwardGraphs | None = None  # set by the runner where they run
        self.write_slot()

    def write_slot(self) -> None:
        """Copy the fp32 masters into the job's slot in the model's dtype."""
        masters = self.optimizer.masters
        for layer, target in self.keys:
            module = getattr(getattr(self.model.model.layers[layer],
                                     TARGET_MODULES[target]), target)
            module.set_slot(self.spec.lora_slot, masters[lora_grad_name(layer, target, "A")],
                            masters[lora_grad_name(layer, target, "B")], self.scaling)

    def _shard(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of tensor `name` (or of one shaped like it); all of it on one rank."""
        if self.sharded is None or name not in self.sharded.params:
            return whole
        return self.sharded.shard(name, whole)

    def whole(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors from this rank's parts (key: a tensor name, or "<name>.<moment>");
        under tensor parallelism a collective every rank calls."""
        if self.sharded is None:
            return tensors
        return self.sharded.gather({key: (key if key in self.sharded.params
                                          else key.rsplit(".", 1)[0], t)
                                    for key, t in tensors.items()})

    def step_norm(self) -> torch.Tensor:
        """The optimizer step; under tensor parallelism the shared entries' partial gradients
        are summed first and clipping uses the whole adapter's norm."""
        if self.sharded is None:
            return self.optimizer.step_norm()
        grads = self.optimizer.grads
        self.sharded.reduce_grads(grads)
        return self.optimizer.step_norm(lambda: self.sharded.total_norm(grads))

    @property
    def writes_files(self) -> bool:
        """Whether this process writes the job's saves: rank 0 of a tensor-parallel group
        (after every rank took part in `whole`), the only one otherwise."""
        return self.sharded is None or self.sharded.tp.rank == 0

    def adapter(self) -> LoRAAdapter:
        """The current weights as a LoRA adapter on the CPU (fp32); under tensor parallelism a
        collective every rank calls."""
        masters = self.whole(self.optimizer.masters)
        weights = {(layer, target): (masters[lora_grad_name(layer, target, "A")].cpu().clone(),
                                     masters[lora_grad_name(layer, target, "B")].cpu().clone())
                   for layer, target in self.keys}
        return LoRAAdapter(rank=self.rank, lora_alpha=self.lora_alpha, weights=weights,
                           use_rslora=self.use_rslora, lora_dropout=self.dropout)


class FinetuneRunner:
    """All fine-tuning jobs of one model runner."""

    def __init__(self, model: Any, hf_config: Any, block_size: int, device: torch.device,
                 dtype: torch.dtype, lora_manager: Any, remat_threshold: float | None = None,
                 loss_chunk_rows: int = 1024, remat_chains: bool = False,
                 activation_budget_gib: float | None = None,
                 max_finetune_len: int | None = None, activation_offload: bool = False,
                 arena: ActivationArena | None = None,
                 on_arena_cleared: Callable[[], None] | None = None,
                 batched_backward: bool = False) -> None:
        self.model = model
        self.hf_config = hf_config
        # activation memory CUDA graphs can write (mixed iterations); None: private stores only
        self.arena = arena
        # called when a job's plan replaces the arena's tensors (the graphs writing them go)
        self.on_arena_cleared = on_arena_cleared
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.lora_manager = lora_manager
        self.remat_threshold = remat_threshold
        self.remat_chains = remat_chains
        self.activation_budget_gib = activation_budget_gib  # None: no budget
        self.activation_offload = activation_offload  # budget: layers to host memory first
        self.max_finetune_len = max_finetune_len  # None: each job's max_seq_len bounds its data
        # run the backward windows of several jobs of a plan as one (`_batch_backward_graphs`)
        self.batched_backward = batched_backward
        self.loss_chunk_rows = loss_chunk_rows
        self.jobs: dict[str, _Job] = {}
        # This step's window losses on the device: (window, is a reference window, pending)
        self._pending_losses: list[tuple[FinetuneWindow, bool, PendingWindowLoss]] = []
        self.num_activation_bytes = 0  # activation-store bytes held now (metrics)
        self._faults: dict[str, str] = {}  # job id -> fault to inject into its next work
        # Static buffers and graph memory of the jobs' captured backward windows (with an arena),
        # kept for later jobs, as are the graphs: (rank, targets, arena layout) -> graphs
        self._backward_cache: dict[tuple, BackwardGraphs] = {}
        self._backward_buffers: BackwardBuffers | None = None
        # by how they ran (tests, metrics); "together": those run with others as one
        # "across_jobs": those run as one with windows of other jobs
        self.num_backward_windows = {"graphs": 0, "eager": 0, "together": 0, "across_jobs": 0}
        self._backward_pool: Any = None

    def inject_fault(self, job_id: str, kind: str) -> None:
        """Poison the job's next piece of work, to test that a failure stays with the job:
        "nan_loss" makes its next window's final hidden states NaN (so the loss is NaN),
        "nan_grad" its gradients NaN after its next backward window (so the optimizer step's
        norm is NaN), "oom" raises `torch.cuda.OutOfMemoryError` in its next window loss or
        backward window. Thread-safe enough for tests: one dict assignment."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; one of {', '.join(FAULT_KINDS)}")
        self._faults[job_id] = kind

    def _take_fault(self, job_id: str, kinds: tuple[str, ...]) -> str | None:
        kind = self._faults.get(job_id)
        if kind in kinds:
            del self._faults[job_id]
            return kind
        return None

    # --------------------------------------------------------------------------------- jobs
    def add_job(self, spec: FinetuneJobSpec) -> PruningPlan:
        """Create the job's adapter in its slot and its optimizer; returns its pruning plan."""
        if spec.job_id in self.jobs:
            raise ValueError(f"fine-tuning job {spec.job_id!r} exists already")
        rank = (spec.init_adapter.rank if spec.init_adapter is not None
                else spec.hyperparameters.lora.r)
        max_rank = self.lora_manager.config.max_lora_rank
        if rank > max_rank:
            raise ValueError(f"LoRA rank {rank} exceeds max_lora_rank {max_rank} (--max-lora-rank): "
                             "the job's adapter lives in a LoRA slot")
        # The slot may still hold an earlier adapter's weights (a served adapter evicted from it,
        # the start-up warm-up's job) on projections this job does not train: they would join its
        # forward but not its gradients, and keep every linear's LoRA kernels running for it.
        self.lora_manager.clear_slot(spec.lora_slot)
        with torch.no_grad():
            job = _Job(spec, self.model, self.hf_config, self.device, self.dtype,
                       self.remat_threshold, self.remat_chains, self.activation_budget_gib,
                       self.max_finetune_len, self.activation_offload)
        self.jobs[spec.job_id] = job
        if self.arena is not None and not job.layer_plans.offload_layers:
            layout = store_layout(job.graph, job.layer_plans.plans, self.dtype)
            if len(self.jobs) == 1 and not self.arena.holds_exactly(layout):
                # The arena still holds an ended job's plan: this job's replaces it, and the
                # graphs that read or wrote the old one go with it.
                self.arena.clear()
                self._backward_cache.clear()
                if self.on_arena_cleared is not None:
                    self.on_arena_cleared()
            if self.arena.conflicts(layout):
                # Another running job's plan holds the arena with other widths (another LoRA
                # rank): this job's stores stay private and its windows run without graphs.
                logger.info("fine-tuning job %s: the activation arena holds another plan's "
                            "tensors (another LoRA rank); its windows run without CUDA graphs",
                            spec.job_id)
            elif self.arena.reserve(layout) and self.job_graph_kept(spec.job_id) is not None:
                # The backward graphs of a plan serve every job of that plan, in any slot (they
                # run on the staging slot): capturing them took 1.7-2.7 s of an 8B model's job
                # start on an H200.
                key = (job.rank, tuple(sorted(job.graph.bypass)), tuple(layout))
                graphs = self._backward_cache.get(key)
                if graphs is None:
                    graphs = self._backward_cache[key] = self._backward_graphs(job)
                job.backward_graphs = graphs
                if self.batched_backward:
                    self._batch_backward_graphs(graphs, job)
        return job.plan

    def _batch_backward_graphs(self, graphs: BackwardGraphs, job: _Job) -> None:
        """Once this job is the second running job of its plan, the pieces that run several
        jobs' windows as one (`BackwardGraphs.prepare_batched`): captured once per plan, like
        the plan's own."""
        sharing = sum(other.backward_graphs is graphs for other in self.jobs.values())
        if sharing < 2 or graphs.max_jobs > 1 or job.dropout > 0 or graphs.capture_failed:
            return
        t0 = time.perf_counter()
        count = graphs.prepare_batched(self._template(job))
        logger.info("fine-tuning job %s: a second job of its plan runs; backward-window pieces "
                    "for up to %d jobs' windows at once (%d graphs) captured in %.1f s",
                    job.spec.job_id, graphs.max_jobs, count, time.perf_counter() - t0)

    def _template(self, job: _Job) -> SequenceBackward:
        """A `SequenceBackward` of the job's plan on the staging slot, with gradient buffers of
        its own: what captured backward pieces run."""
        store = ActivationStore(job.graph, job.layer_plans.plans,
                                len(self.model.model.layers), 1, self.dtype, self.device)
        grads = {name: torch.zeros_like(grad) for name, grad in job.optimizer.grads.items()}
        return SequenceBackward(self.model, store, 1, [0], self.block_size,
                                self.lora_manager.staging_slot, grads)

    def _backward_graphs(self, job: _Job) -> BackwardGraphs:
        """The job's backward windows as pieces around attention (`BackwardGraphs`), captured
        now on CUDA rather than in its first iterations."""
        if self._backward_buffers is None:
            max_rows = backward_buckets(self.max_finetune_len or job.layer_plans.max_num_tokens)[-1]
            self._backward_buffers = BackwardBuffers(max_rows, self.hf_config.hidden_size,
                                                     self.device)
            if self.device.type == "cuda":
                self._backward_pool = torch.cuda.graph_pool_handle()
        # The graphs read the staging slot and add into gradient buffers of their own; each
        # window's job has its layer's weights copied in before and the gradients added into
        # its own after (`BackwardGraphs.run_many`).
        graphs = BackwardGraphs(self._template(job), self.arena, self._backward_buffers,
                                self._backward_pool)
        t0 = time.perf_counter()
        count = graphs.prepare()
        if graphs.capture_failed:
            self._backward_pool = torch.cuda.graph_pool_handle()  # the failed one is refused
        if count:
            logger.info("fine-tuning job %s: %d backward-window graphs (%d row buckets up to "
                        "%d rows, two pieces per layer around attention) captured in %.1f s",
                        job.spec.job_id, count, len(graphs.buckets), graphs.buckets[-1],
                        time.perf_counter() - t0)
        return graphs

    def end_job(self, job_id: str) -> None:
        job = self.jobs.get(job_id)
        if job is not None:
            _drop_sequences(job)
            self._count_bytes()

    def remove_job(self, job_id: str) -> None:
        self._faults.pop(job_id, None)
        job = self.jobs.pop(job_id, None)
        if job is not None:
            _drop_sequences(job)
            job.backward_graphs = None
            # An ended job gave its slot back: a later job may hold it now.
            if all(other.spec.lora_slot != job.spec.lora_slot for other in self.jobs.values()):
                self.lora_manager.clear_slot(job.spec.lora_slot)
            self._count_bytes()

    def save_adapter(self, job_id: str, path: str, base_model_name_or_path: str | None) -> None:
        job = self._job(job_id)
        adapter = job.adapter()
        if job.writes_files:
            save_peft_adapter(adapter, path, base_model_name_or_path)

    def adapter(self, job_id: str) -> LoRAAdapter:
        return self._job(job_id).adapter()

    def save_checkpoint(self, job_id: str, directory: str, trainer_state: dict[str, Any],
                        base_model_name_or_path: str | None) -> None:
        """Write the job's checkpoint atomically (`flexserve.finetune.checkpoint`): the adapter
        in PEFT format (fp32 masters), the AdamW state, and `trainer_state` (the engine's data
        position). Only between optimizer steps: ValueError while a sequence holds state."""
        job = self._job(job_id)
        if job.sequences:
            raise ValueError(f"fine-tuning job {job_id} has sequences in flight: checkpoint "
                             "between optimizer steps")
        step = trainer_state.get("step")
        if step != job.optimizer.num_completed_steps:
            raise ValueError(f"the engine is at step {step}, the optimizer at "
                             f"{job.optimizer.num_completed_steps}")
        adapter = job.adapter()
        tensors, config = job.optimizer.checkpoint_state()
        tensors = {key: t.cpu() for key, t in job.whole(tensors).items()}
        if not job.writes_files:
            return

        def write(path: str) -> None:
            save_peft_adapter(adapter, path, base_model_name_or_path)
            write_optimizer_state(path, tensors, config)
            write_json(os.path.join(path, TRAINER_STATE_NAME), trainer_state)

        commit_directory(directory, write)

    def _job(self, job_id: str) -> _Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise ValueError(f"no fine-tuning job {job_id!r} on this worker")
        return job

    def has_sequence(self, window: FinetuneWindow) -> bool:
        return self._sequence(window.job_id, window.sequence_id) is not None

    def token_ids(self, job_id: str, sequence_id: int) -> list[int]:
        seq = self._sequence(job_id, sequence_id)
        if seq is None:
            raise ValueError(f"fine-tuning sequence {job_id}:{sequence_id} was not started")
        return seq.start.token_ids

    def block_ids(self, job_id: str, sequence_id: int) -> list[int]:
        seq = self._sequence(job_id, sequence_id)
        if seq is None:
            raise ValueError(f"fine-tuning sequence {job_id}:{sequence_id} was not started")
        return seq.start.block_ids

    # --------------------------------------------------------------------------------- a step
    def start_sequences(self, starts: list[FinetuneSequenceStart], errors: dict[str, str]) -> None:
        for start in starts:
            job = self.jobs.get(start.job_id)
            if job is None or start.job_id in errors:
                continue
            if start.reference:
                job.sequences[start.sequence_id] = _Sequence(start, None, None)
                continue
            store = None
            try:
                n = len(start.token_ids)
                store = ActivationStore(
                    job.graph, job.layer_plans.plans, len(self.model.model.layers), n, self.dtype,
                    self.device, lora_dropout=job.dropout,
                    dropout_seed=_dropout_seed(job.spec.seed, start.sequence_id),
                    offload_layers=job.layer_plans.offload_layers,
                    offload_host_rows=job.layer_plans.max_num_tokens, arena=self.arena)
                backward = SequenceBackward(self.model, store, n, start.block_ids,
                                            self.block_size, job.spec.lora_slot,
                                            job.optimizer.grads)
                backward.graphs = job.backward_graphs
                job.sequences[start.sequence_id] = _Sequence(start, store, backward)
            except Exception as e:  # this job's failure (OOM included), never the engine's
                if store is not None:
                    store.release()
                self._fail(start.job_id, e, errors, "starting a sequence")
        self._count_bytes()

    def capture_windows(self, windows: list[FinetuneWindow], first_row: int,
                        errors: dict[str, str]) -> FinetuneCapture:
        """The forward context's capture; window i's rows start at `first_row` + earlier ones."""
        capture = FinetuneCapture()
        row = first_row
        for window in windows:
            seq = self._sequence(window.job_id, window.sequence_id)
            n = window.end - window.start
            if seq is not None and seq.store is not None and window.job_id not in errors:
                capture.add_window(seq.store, row, window.start, n, window.lora_slot)
            row += n
        return capture

    def graph_kept(self, windows: list[FinetuneWindow], errors: dict[str, str]
                   ) -> dict[tuple[int, str], KeptTensor] | None:
        """What a `GraphCapture` of these windows keeps: (layer, name) -> layout of the one plan
        of their stores; None when some window needs the eager `capture_windows` (a store
        outside the arena, LoRA dropout, a kept mask or delta, plans that differ) or none runs."""
        sequences = [seq for seq in (self._sequence(w.job_id, w.sequence_id) for w in windows
                                     if w.job_id not in errors) if seq is not None]
        stores = [seq.store for seq in sequences]
        if not stores or self.arena is None or None in stores:
            return None  # reference windows run eagerly
        names = stores[0].stored_names
        for store in stores:
            if (store.arena is None or store.lora_dropout > 0 or store.stored_names != names
                    or any(store.bitmask_names)
                    or any(n.endswith(UNSUPPORTED_SUFFIXES) for layer in names for n in layer)):
                return None
        return {(layer, name): KeptTensor(*stores[0].buffer_spec(layer, name))
                for layer, layer_names in enumerate(names) for name in layer_names}

    def job_graph_kept(self, job_id: str) -> dict[tuple[int, str], KeptTensor] | None:
        """What a `GraphCapture` keeps for the windows of this job (as `graph_kept` finds them
        on its sequences' stores), or None when they will run eagerly."""
        job = self.jobs.get(job_id)
        if (job is None or self.arena is None or job.dropout > 0
                or job.layer_plans.offload_layers):
            return None
        layout = store_layout(job.graph, job.layer_plans.plans, self.dtype)
        if any(dtype == torch.uint8 or name.endswith(UNSUPPORTED_SUFFIXES)
               or not self.arena.holds(layer, name, width, dtype)
               for layer, name, width, dtype in layout):
            return None
        return {(layer, name): KeptTensor(width, dtype) for layer, name, width, dtype in layout}

    def admit_graph_windows(self, windows: list[FinetuneWindow], first_row: int,
                            errors: dict[str, str]
                            ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
        """Admit the windows `graph_kept` accepted into their stores (a graph writes them):
        (flat source rows, arena rows, (flat start, tokens) per window); window i's rows start
        at `first_row` + earlier windows' tokens."""
        src, dest, spans = [], [], []
        row = first_row
        for window in windows:
            seq = self._sequence(window.job_id, window.sequence_id)
            n = window.end - window.start
            if seq is not None and window.job_id not in errors:
                store = seq.store
                store.begin_window(window.start, n)
                store.mark_written(window.start, n)
                src.append(np.arange(row, row + n))
                dest.append(np.arange(store.arena_base + window.start,
                                      store.arena_base + window.end))
                spans.append((row, n))
            row += n
        return np.concatenate(src), np.concatenate(dest), spans

    def window_losses(self, capture: FinetuneCapture, windows: list[FinetuneWindow],
                      errors: dict[str, str]) -> None:
        # The capture holds the windows `capture_windows` admitted (errors do not change during
        # the forward); a job failing below must not shift the later windows' indices.
        captured = [w for w in windows if w.job_id not in errors
                    and self._sequence(w.job_id, w.sequence_id) is not None
                    and self._sequence(w.job_id, w.sequence_id).store is not None]
        for index, window in enumerate(captured):
            seq = self._sequence(window.job_id, window.sequence_id)
            if seq is None or window.job_id in errors:
                continue
            try:
                start = seq.start
                grad_out = seq.backward.residual_grad[window.start:window.end]
                hidden = capture.final_stream(index)
                fault = self._take_fault(window.job_id, ("nan_loss", "oom"))
                if fault == "oom":
                    raise torch.cuda.OutOfMemoryError("out of memory (injected fault)")
                if fault == "nan_loss":
                    hidden = hidden * float("nan")
                self._pending_losses.append((window, False, window_loss_async(
                    self.model, hidden, seq.window_targets(hidden.device), window.start,
                    grad_out, start.loss_scale, self.loss_chunk_rows)))
            except Exception as e:  # this job's failure (OOM included), never the engine's
                self._fail(window.job_id, e, errors, "its forward window's loss")

    def read_losses(self, losses: dict, errors: dict[str, str], later: bool = False
                    ) -> Callable[[], None] | None:
        """The step's window losses and reference log-probabilities into `losses` as (sum,
        tokens, correct), copied from the device at once; a non-finite one fails its job.
        `later`: only start the copy, and return the call that waits for it and folds the
        losses in (a step whose result is waited for after the next one launched)."""
        pending, self._pending_losses = self._pending_losses, []
        if not pending:
            return None
        copy = copy_window_losses([p for _, _, p in pending])

        def fold() -> None:
            for (window, reference, _), loss in zip(pending, copy.read()):
                if window.job_id in errors:
                    continue
                if not math.isfinite(loss.loss_sum):
                    error = FloatingPointError(
                        f"the reference log-probability is {-loss.loss_sum} in sequence "
                        f"{window.sequence_id}: the reference model overflows" if reference else
                        f"the training loss is {loss.loss_sum} in sequence {window.sequence_id} "
                        f"(tokens {window.start}-{window.end}): the job diverged; retry with a "
                        "lower learning rate")
                    self._fail(window.job_id, error, errors, "its reference window"
                               if reference else "its forward window's loss")
                    continue
                losses[(window.job_id, window.sequence_id)] = (loss.loss_sum, loss.num_tokens,
                                                               loss.num_correct)

        if later:
            return fold
        fold()
        return None

    def reference_logprobs(self, hidden: torch.Tensor, windows: list[FinetuneWindow],
                           first_row: int, errors: dict[str, str]) -> None:
        """The summed cross-entropy of the loss tokens of each reference window (DPO), from the
        forward's final hidden states `hidden` [T, hidden] (window i's rows start at `first_row`
        + earlier windows' tokens), into `losses` as (sum, tokens, correct) like a window loss."""
        row = first_row
        for window in windows:
            n = window.end - window.start
            seq = self._sequence(window.job_id, window.sequence_id)
            if seq is not None and seq.store is None and window.job_id not in errors:
                try:
                    self._pending_losses.append((window, True, window_logprob_sum_async(
                        self.model, hidden[row:row + n], seq.window_targets(hidden.device),
                        window.start, self.loss_chunk_rows)))
                except Exception as e:  # this job's failure (OOM included), never the engine's
                    self._fail(window.job_id, e, errors, "its reference window")
            row += n

    def run_backward(self, windows: list[BackwardWindow], errors: dict[str, str],
                     grad_scales: list[tuple[str, int, float]] = ()) -> None:
        for job_id, sequence_id, factor in grad_scales:
            seq = self._sequence(job_id, sequence_id)
            if seq is not None and seq.backward is not None and job_id not in errors:
                seq.backward.residual_grad.mul_(factor)
        for group in self._backward_groups(windows, errors):
            group = [(w, seq) for w, seq in group if w.job_id not in errors]
            job_ids = list(dict.fromkeys(w.job_id for w, _ in group))
            for job_id in job_ids:
                if self._take_fault(job_id, ("oom",)):
                    self._fail(job_id, torch.cuda.OutOfMemoryError(
                        "out of memory (injected fault)"), errors, "a backward window")
            group = [(w, seq) for w, seq in group if w.job_id not in errors]
            if not group:
                continue
            try:
                if len(group) == 1:
                    window, seq = group[0]
                    graphed = seq.backward.backward_window(window.layer, window.start,
                                                           window.end)
                    self.num_backward_windows["graphs" if graphed else "eager"] += 1
                else:
                    self._backward_together(group)
            except Exception as e:  # the group's jobs' failure (OOM included), not the engine's
                # Windows of several jobs ran as one: which one failed is unknown, and each
                # one's state is partly updated.
                for job_id in job_ids:
                    if job_id not in errors:
                        self._fail(job_id, e, errors, "a backward window")
                continue
            for job_id in job_ids:
                if self._take_fault(job_id, ("nan_grad",)):
                    for grad in self.jobs[job_id].optimizer.grads.values():
                        grad.fill_(float("nan"))
        self._count_bytes()

    def _backward_groups(self, windows: list[BackwardWindow], errors: dict[str, str]
                         ) -> list[list[tuple[BackwardWindow, _Sequence]]]:
        """The plan's backward windows in order, consecutive windows of one layer on distinct
        sequences whose jobs share backward pieces grouped (their rows together within the
        largest graph bucket, their jobs at most `BackwardGraphs.max_jobs`), so they run as one
        (`BackwardGraphs.run_many`); a sequence's windows keep their order (a second window of
        a sequence starts a new group)."""
        groups: list[list[tuple[BackwardWindow, _Sequence]]] = []
        open_key, open_rows = None, 0  # the group windows may still join
        open_ids: set[tuple[str, int]] = set()
        open_jobs: set[str] = set()
        for window in windows:
            seq = self._sequence(window.job_id, window.sequence_id)
            if seq is None or window.job_id in errors:
                continue
            n = window.end - window.start
            graphs = seq.backward.graphs
            if graphs is None or not graphs.runs(seq.backward, window.layer, n):
                groups.append([(window, seq)])
                open_key = None
                continue
            key = (id(graphs), window.layer)
            ident = (window.job_id, window.sequence_id)
            if (key == open_key and ident not in open_ids
                    and open_rows + n <= graphs.buckets[-1]
                    and len(open_jobs | {window.job_id}) <= graphs.max_jobs):
                groups[-1].append((window, seq))
                open_rows += n
            else:
                groups.append([(window, seq)])
                open_key, open_rows = key, n
                open_ids, open_jobs = set(), set()
            open_ids.add(ident)
            open_jobs.add(window.job_id)
        return groups

    def _backward_together(self, group: list[tuple[BackwardWindow, _Sequence]]) -> None:
        """Windows of one layer on several sequences (of one job or several), as one window of
        their rows."""
        layer = group[0][0].layer
        for window, seq in group:
            seq.backward.begin_window(layer, window.start, window.end)
        with torch.no_grad():
            group[0][1].backward.graphs.run_many(
                layer, [(seq.backward, window.start, window.end) for window, seq in group])
        for window, seq in group:
            seq.backward.end_window(layer, window.start)
        self.num_backward_windows["graphs"] += len(group)  # the pieces (CUDA graphs on CUDA)
        self.num_backward_windows["together"] += len(group)
        if len({window.job_id for window, _ in group}) > 1:
            self.num_backward_windows["across_jobs"] += len(group)

    def optimizer_steps(self, job_ids: list[str], grad_norms: dict[str, float],
                        errors: dict[str, str], later: bool = False) -> Callable[[], None] | None:
        """Step each job's optimizer; its gradient norm goes into `grad_norms`, and a
        non-finite one fails the job. `later`: the norms are read by the returned call (see
        `read_losses`)."""
        norms = []
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None or job_id in errors:
                continue
            try:
                with torch.no_grad():
                    norm = job.step_norm()
                    job.write_slot()
                norms.append((job_id, norm))
            except Exception as e:  # this job's failure (OOM included), never the engine's
                self._fail(job_id, e, errors, "its optimizer step")
        if not norms:
            return None
        copy = HostCopy(torch.stack([norm.float() for _, norm in norms]))

        def fold() -> None:
            for (job_id, _), value in zip(norms, copy.tolist()):
                if job_id in errors:
                    continue
                if not math.isfinite(value):
                    self._fail(job_id, RuntimeError(
                        f"the gradient norm is {value}: the step diverged"), errors,
                        "its optimizer step")
                    continue
                grad_norms[job_id] = value

        if later:
            return fold
        fold()
        return None

    def finish_sequences(self, finished: list[tuple[str, int]]) -> None:
        for job_id, sequence_id in finished:
            job = self.jobs.get(job_id)
            if job is not None:
                _drop_sequences(job, sequence_id)
        self._count_bytes()

    # ------------------------------------------------------------------------------ internals
    def _sequence(self, job_id: str, sequence_id: int) -> _Sequence | None:
        job = self.jobs.get(job_id)
        return None if job is None else job.sequences.get(sequence_id)

    def _fail(self, job_id: str, error: Exception, errors: dict[str, str], during: str) -> None:
        """End the job's part of this step: the engine marks it failed with `errors[job_id]`.
        Under tensor parallelism only failures every rank meets alike (a non-finite loss or
        norm, which the ranks computed together; bad input) end the job alone: one rank's own
        (out of memory, a bug) is raised, so the executor stops every rank rather than leave
        the others waiting in a collective for a job this rank dropped."""
        distributed = getattr(getattr(self.model, "tp", None), "world_size", 1) > 1
        if distributed and (isinstance(error, torch.cuda.OutOfMemoryError) or not isinstance(
                error, (ValueError, RuntimeError, FloatingPointError))):
            raise error
        job = self.jobs.get(job_id)
        if job is not None:
            _drop_sequences(job)  # its activation stores and gradient buffers go now
        self._faults.pop(job_id, None)
        if isinstance(error, torch.cuda.OutOfMemoryError):
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # hand the freed blocks back to inference and jobs
            message = (f"out of device memory during {during}: the job was stopped and its "
                       "activations freed; retry it with a smaller batch_size or max_seq_len, "
                       "or when the server is less busy")
        elif isinstance(error, (ValueError, RuntimeError, FloatingPointError)):
            message = str(error)
        else:  # a bug: the trace goes to the log, the job's error names the exception
            logger.exception("fine-tuning job %s: unexpected error during %s", job_id, during)
            message = f"internal error during {during} ({type(error).__name__})"
        logger.error("fine-tuning job %s failed: %s", job_id, message)
        errors[job_id] = message
        self._count_bytes()

    def _count_bytes(self) -> None:
        self.num_activation_bytes = sum(
            seq.store.num_bytes for job in self.jobs.values() for seq in job.sequences.values()
            if seq.store is not None)


def _drop_sequences(job: _Job, sequence_id: int | None = None) -> None:
    """Forget one sequence of the job (None: all), returning their arena rows."""
    ids = list(job.sequences) if sequence_id is None else [sequence_id]
    for i in ids:
        seq = job.sequences.pop(i, None)
        if seq is not None and seq.store is not None:
            seq.store.release()


def _dropout_seed(job_seed: int, sequence_id: int) -> int:
    """A distinct dropout stream per sequence of a job (31 bits)."""
    return (job_seed * 1_000_003 + sequence_id) & 0x7FFFFFFF

"""Turns a `BatchPlan` into tensors, runs the model once over all rows, samples, returns a result."""

from __future__ import annotations

import array
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from flexserve.config import EngineConfig
from flexserve.distributed.parallel_state import get_pp_stage, get_tp_group, world_min
from flexserve.engine.lora_request import LoRARequest
from flexserve.engine.plan import (
    BatchPlan,
    FinetuneWindow,
    ScheduledSequence,
    StepResult,
    TokenLogprobs,
)
from flexserve.finetune.checkpoint import read_optimizer_state
from flexserve.layers.attention import AttentionMetadata
from flexserve.layers.device_copy import HostCopy, to_device
from flexserve.layers.forward_context import set_forward_context
from flexserve.layers.lora_linear import LoRALinear
from flexserve.layers.sampler import (
    Sampler,
    SamplingMetadata,
    compute_prompt_logprobs,
    to_token_logprobs,
)
from flexserve.model.loader import load_model, resolve_dtype
from flexserve.model.registry import ResolvedModel
from flexserve.peft.bypass import target_shapes
from flexserve.peft.graph_pruning import PruningPlan
from flexserve.peft.peft_io import load_peft_adapter
from flexserve.sampling_params import StructuredOutputsParams
from flexserve.worker.cuda_graphs import CUDAGraphRunner
from flexserve.worker.finetune.activation_arena import ActivationArena
from flexserve.worker.finetune.graph_capture import GraphCapture
from flexserve.worker.finetune.runner import FinetuneJobSpec, FinetuneRunner
from flexserve.worker.kv_cache import (
    KVCacheSpec,
    allocate_kv_caches,
    num_blocks_from_memory,
)
from flexserve.worker.lora_manager import LoRAManager
from flexserve.worker.mixed_graphs import MixedGraphRunner, MixedStep
from flexserve.worker.structured_outputs import GrammarManager
from flexserve_kernels.dispatch import use_triton
from flexserve_kernels.lora.serve.cuda_ext import load_for_decode
from flexserve_kernels.lora.serve.meta import LoRAKernelMeta

logger = logging.getLogger(__name__)

# Rows a mixed iteration's graph holds beyond max_num_seqs: the fine-tuning windows.
MAX_WINDOW_ROWS = 16
# max_finetune_len rows' worth of activations in the arena: one bin of sequences (the scheduler
# starts the next bin after the last backward window of this one).
ARENA_SEQUENCES = 1


def _micro_batches(lengths: list[int], count: int) -> list[tuple[int, int]]:
    """Split rows of these token counts into at most `count` consecutive groups of about equal
    tokens: (first, end) row ranges, none empty."""
    total, groups, first, acc = sum(lengths), [], 0, 0
    for i, n in enumerate(lengths):
        acc += n
        if acc * count >= total * (len(groups) + 1) and len(groups) < count - 1:
            groups.append((first, i + 1))
            first = i + 1
    if first < len(lengths):
        groups.append((first, len(lengths)))
    return groups


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def _after_device(fill: Callable[[], None] | None, folds: list[Callable[[], None] | None]
                  ) -> Callable[[], None]:
    """The call that waits for the step's device work (up to now), then fills in its sampled
    tokens and folds its window losses and gradient norms in (in that order: a job a loss
    fails keeps no gradient norm)."""
    done = torch.cuda.Event()
    done.record()

    def wait() -> None:
        done.synchronize()
        if fill is not None:
            fill()
        for fold in folds:
            if fold is not None:
                fold()

    return wait


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler on one device.

    Under tensor parallelism every rank runs one, over its shard of the model and of the KV
    cache (its key/value heads), on the same plans; the gathered logits and the shared sampler
    seed make every rank sample the same tokens."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel) -> None:
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.hf_config = resolved.hf_config
        self.tp = get_tp_group()
        self.pp = get_pp_stage()
        start = time.perf_counter()
        self.model = load_model(config.model, resolved, self.device, self.dtype)
        logger.info(
            "loaded %s on %s (%s) in %.1f s", resolved.name, self.device,
            str(self.dtype).removeprefix("torch."), time.perf_counter() - start,
        )
        if use_triton(self.device):
            self.model.merge_projections()  # one GEMM for q/k/v and one for gate/up
        self.vocab_size = self.hf_config.vocab_size
        self.block_size = config.cache.block_size
        self.kv_cache_spec = KVCacheSpec(
            num_layers=len(self.model.model.local_layers),  # this pipeline stage's
            num_kv_heads=self.model.layout.num_local_kv_heads,
            head_dim=self.model.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
        )
        self.sampler = Sampler(seed=config.model.seed, device=self.device)
        # Before the KV cache is sized, so the slots' memory is accounted for.
        self.lora_manager = None
        if config.lora is not None:
            self.lora_manager = LoRAManager(
                self.model, config.lora, self.hf_config, self.device, self.dtype,
                config.finetune)
            if use_triton(self.device):
                # The CUDA BGMV extension for LoRA decode (FLEXSERVE_LORA_DECODE_BACKEND auto or
                # cuda): built now, before the profiling forward and CUDA-graph capture, never
                # inside a capture or under a request; under auto only where down_proj's decode
                # runs the BGMV pair (its shrinks not folded into the GEMM).
                layers = getattr(getattr(self.model, "model", None), "local_layers", ())
                load_for_decode(self.device, bgmv_pairs=not layers or any(
                    getattr(getattr(layer.mlp, "down", None), "folded", None) is None
                    for layer in layers))
        self.num_blocks = 0
        # Sequence length the cuDNN plans of whole-prefix backward windows were built for
        # (`finetune_warmup.warmup_window_attention`); `prepare_thread` builds them again.
        self.warm_prefix_len: int | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.graph_runner: CUDAGraphRunner | None = None
        self.mixed_graphs: MixedGraphRunner | None = None  # CUDA: graphs of mixed iterations
        self._arena: ActivationArena | None = None  # fine-tuning activations graphs can write
        self._lora_linears = [m for m in self.model.modules() if isinstance(m, LoRALinear)]
        self.finetune_runner: FinetuneRunner | None = None  # created by the first job
        self._stream: torch.cuda.Stream | None = None  # fine-tuning's side stream (CUDA)
        # The last plan's sampled tokens, on the device: a continuation plan's inputs
        # (asynchronous scheduling).
        self._last_sampled: torch.Tensor | None = None
        # CUDA: their copy on its way to pinned host memory and the event that marks it landed
        # (structured outputs read them from there without waiting for the next forward)
        self._last_sampled_host: HostCopy | None = None
        # Structured outputs: the tokenizer their grammars are compiled against (`set_tokenizer`)
        # and the matchers, made with the first constrained request.
        self._tokenizer: Any | None = None
        self._stop_token_ids: list[int] = []
        self.grammars: GrammarManager | None = None
        self._grammars_lock = threading.Lock()

    def set_tokenizer(self, tokenizer: Any | None, eos_token_id: int | None) -> None:
        """The tokenizer structured outputs compile their grammars against; its EOS ends them."""
        self._tokenizer = tokenizer
        self._stop_token_ids = [] if eos_token_id is None else [eos_token_id]

    def prepare_thread(self) -> None:
        """Per-thread start-up for a thread other than the loading one that runs this runner's
        steps (the server's engine thread): the cuDNN plans of whole-prefix backward windows,
        which torch keeps per thread, for the length the warm-up built them for. Windows of a
        thread without them run flash (`backward_ops.window_attention`)."""
        if self.warm_prefix_len is not None:
            from flexserve.worker.finetune.warmup import warmup_window_attention

            warmup_window_attention(self, self.warm_prefix_len)

    # ----------------------------------------------------------------------------------- KV cache

    def initialize_kv_cache(self, max_model_len: int) -> int:
        """Size the cache from memory (after a profiling forward on CUDA), allocate it, bind it."""
        peak = self._profile_activation_peak(max_model_len) if self.device.type == "cuda" else 0
        if self.lora_manager is not None:  # kept free for fine-tuning jobs' training state
            peak += self.lora_manager.finetune_state_bytes
        # Every rank (every stage) holds the same blocks: as many as the smallest fits.
        self.num_blocks = world_min(num_blocks_from_memory(
            self.kv_cache_spec, self.config.cache, self.device, peak
        ))
        self.kv_caches = allocate_kv_caches(self.kv_cache_spec, self.num_blocks, self.device)
        self.model.bind_kv_caches(self.kv_caches)
        # Graphs replay the Triton path only (the torch reference attention is not graph-safe).
        graphs = (self.device.type == "cuda" and not self.config.model.enforce_eager
                  and use_triton(self.device))
        if graphs and self.pp.num_stages > 1:
            logger.info("CUDA graphs are off under pipeline parallelism: stages run eagerly")
            graphs = False
        if graphs:
            self.graph_runner = CUDAGraphRunner(
                self.model, self.config.scheduler.max_num_seqs, max_model_len, self.block_size,
                self.hf_config.num_key_value_heads, self.device,
                with_lora=self.lora_manager is not None,
            )
            self.graph_runner.capture()
            self.enable_mixed_graphs(max_model_len)
            self.mixed_graphs.precapture()
        return self.num_blocks

    def enable_mixed_graphs(self, max_model_len: int) -> None:
        """Run every iteration that is not decode-only through `MixedGraphRunner` (on CUDA its
        captured graphs; elsewhere the same padded forward without a graph, for tests). Call
        before the first fine-tuning job (its activation stores come from the arena)."""
        sched = self.config.scheduler
        self.mixed_graphs = MixedGraphRunner(
            self.model, sched.max_num_batched_tokens, sched.max_num_seqs + MAX_WINDOW_ROWS,
            max_model_len, self.block_size, self.hf_config.num_attention_heads,
            self.hf_config.num_key_value_heads, self.model.head_dim, self.dtype, self.device,
            arena_of=lambda: self._arena)

    @torch.inference_mode()
    def _profile_activation_peak(self, max_model_len: int) -> int:
        """Activation bytes of the largest step: a full token budget plus logits for many rows."""
        sched = self.config.scheduler
        num_tokens = min(sched.max_num_batched_tokens, max_model_len)
        num_rows = max(1, min(sched.max_num_seqs, num_tokens))
        query_lens = [num_tokens // num_rows] * num_rows
        query_lens[-1] += num_tokens - sum(query_lens)
        blocks_per_row = [-(-q // self.block_size) for q in query_lens]
        scratch = allocate_kv_caches(self.kv_cache_spec, sum(blocks_per_row), self.device)
        self.model.bind_kv_caches(scratch)
        tables, first = [], 0
        for n in blocks_per_row:
            tables.append(list(range(first, first + n)))
            first += n
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        metadata = AttentionMetadata.build(query_lens, [0] * num_rows, tables, self.block_size, self.device)
        # Every token through slot 0 (zeros): the LoRA path's activations count in the peak.
        lora_meta = None if self.lora_manager is None else LoRAKernelMeta.build(
            query_lens, [0] * num_rows, self.device)
        input_ids = torch.randint(0, self.vocab_size, (num_tokens,), device=self.device)
        positions = torch.cat([torch.arange(q, device=self.device) for q in query_lens])
        intermediate = None
        if not self.pp.is_first:  # a later pipeline stage starts from the previous one's
            shape = (num_tokens, self.hf_config.hidden_size)
            intermediate = tuple(torch.zeros(shape, dtype=self.dtype, device=self.device)
                                 for _ in range(2))
        with set_forward_context(metadata, lora_meta):
            hidden = self.model(input_ids, positions, intermediate)
        logits = None
        if self.pp.is_last:
            logits = self.model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1])
            torch.softmax(logits, dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch, hidden, logits, metadata
        self.model.bind_kv_caches([])
        torch.cuda.empty_cache()
        return peak

    # ---------------------------------------------------------------------------------- execution
    def execute(self, plan: BatchPlan) -> StepResult:
        """Run every row of the plan in one forward, inference rows first, then fine-tuning
        forward windows; sample rows that reached their end; then the plan's backward windows
        and optimizer steps. Fine-tuning keeps tensors past the step for a backward, so such
        steps run under no_grad instead of inference_mode."""
        return self.execute_async(plan)()

    def execute_async(self, plan: BatchPlan) -> Callable[[], StepResult]:
        """Launch the plan and return the call that waits for its result (`EngineCore`'s
        asynchronous scheduling). On CUDA the sampled tokens reach the host through a
        non-blocking copy the call waits for, so the host can prepare the next plan while the
        device runs this one. Steps with fine-tuning work, logprobs or prompt logprobs finish
        before this returns."""
        start = time.perf_counter()
        finetune = plan.has_finetune_work
        with torch.no_grad() if finetune else torch.inference_mode():
            result, fill = self._execute(plan, finetune)

        def wait() -> StepResult:
            if fill is not None:
                fill()
            result.execute_time = time.perf_counter() - start
            return result

        return wait

    def _execute(self, plan: BatchPlan, finetune: bool
                 ) -> tuple[StepResult, Callable[[], None] | None]:
        """The result, and the call that fills in its sampled tokens once their copy to the
        host lands (None: they are in already, and the device is done)."""
        result = StepResult()
        rows = plan.sequences
        errors = result.finetune_errors
        if self.grammars is not None and plan.finished_request_ids:
            self.grammars.release(plan.finished_request_ids)
        if plan.lora_slot_loads:
            result.lora_load_errors = self._lora().load_slots(plan.lora_slot_loads)
        if finetune:
            self._finetune().start_sequences(plan.finetune_starts, errors)
        # Windows of a job that failed (now or earlier) leave the batch; the engine ends the job.
        windows = [w for w in plan.finetune_windows
                   if w.job_id not in errors and self._finetune().has_sequence(w)] \
            if plan.finetune_windows else []
        cuda = self.device.type == "cuda"
        side_stream = None
        if cuda and finetune and (plan.finetune_concurrent or (
                plan.backward_windows and self.config.coserve.finetune_backward_stream)):
            side_stream = self._side_stream()
            side_stream.wait_stream(torch.cuda.current_stream(self.device))
        # A step with fine-tuning work on one stream returns before the device ends it, as a
        # decode step does: its sampled tokens, window losses and gradient norms come back
        # through copies the returned call waits for (the next step is launched meanwhile).
        # With a second stream, which must join, the step waits here.
        later = cuda and finetune and side_stream is None
        if side_stream is not None:
            # The inference forward is launched first and sampled last, so the fine-tuning
            # work queued on the side stream in between runs concurrently with it.
            concurrent = plan.finetune_concurrent
            sample = self._forward(rows, [] if concurrent else windows, result, plan)
            fill = None
            # The side stream's all-reduces go through NCCL: the one-shot all-reduce's buffer
            # serves one stream.
            with torch.cuda.stream(side_stream), self.tp.nccl_only():
                if concurrent:  # spatial sharing: fine-tuning is its own forward, eager: the
                    # graphs' static inputs belong to the inference forward on the other stream
                    self._forward([], windows, result, plan, use_graphs=False)()
                # FlexLLM figure 9: backward windows touch only their own sequences' K/V
                # blocks, activation stores and gradient buffers; adapter weights change only
                # in the optimizer step, after both streams joined.
                self._finetune().run_backward(plan.backward_windows, errors,
                                              plan.finetune_grad_scales)
            sample()
        else:
            fill = self._forward(rows, windows, result, plan, deferred=not finetune or later)()
            if finetune:
                self._finetune().run_backward(plan.backward_windows, errors,
                                              plan.finetune_grad_scales)
        if side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(side_stream)
        if finetune:
            runner = self._finetune()
            folds = [runner.read_losses(result.finetune_losses, errors, later),
                     runner.optimizer_steps(plan.optimizer_steps, result.grad_norms, errors,
                                            later)]
            runner.finish_sequences(plan.finished_finetune_sequences)
            if later:
                fill = _after_device(fill, folds)
        if cuda and fill is None:
            torch.cuda.synchronize(self.device)
        return result, fill

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _forward(self, rows: list[ScheduledSequence], windows: list[FinetuneWindow],
                 result: StepResult, plan: BatchPlan, deferred: bool = False,
                 use_graphs: bool = True) -> Callable[[], Callable[[], None] | None]:
        """Launch one forward over inference rows then fine-tuning windows, with the windows'
        losses (their gradients are kept for backward). Returns the call that samples the rows
        that reached their end and computes prompt logprobs; it waits for the device and
        returns None, unless `deferred` and the sampled tokens are all the step returns: then
        it returns the call that waits for them (`_sample`)."""
        row_lens = [r.num_scheduled_tokens for r in rows] + [w.end - w.start for w in windows]
        if not row_lens:
            return lambda: None
        if self.pp.num_stages > 1:
            return self._forward_pipelined(rows, result, plan, deferred)
        errors = result.finetune_errors
        row_slots = [r.lora_slot for r in rows] + [w.lora_slot for w in windows]
        if plan.continues_previous:
            input_ids = self._continuation_input_ids(len(rows))
            if windows:
                input_ids = torch.cat([input_ids, self._prepare_input_ids([], windows)])
        else:
            input_ids = self._prepare_input_ids(rows, windows)
        num_computed = [r.num_computed_tokens for r in rows] + [w.start for w in windows]
        block_tables = [r.block_ids for r in rows] + [
            self._finetune().block_ids(w.job_id, w.sequence_id) for w in windows]
        metadata = AttentionMetadata.build(
            row_lens, num_computed, block_tables, self.block_size, self.device)
        positions = metadata.positions  # the rows' positions, already on the device
        lora_meta = None
        if self.lora_manager is not None and any(slot >= 0 for slot in row_slots):
            lora_meta = LoRAKernelMeta.build(row_lens, row_slots, self.device)
        capture = None
        num_inference_tokens = sum(r.num_scheduled_tokens for r in rows)
        if (use_graphs and not windows and self.graph_runner is not None
                and metadata.max_query_len == 1
                and self.graph_runner.can_run(len(rows), metadata.max_seq_len)):
            hidden = self.graph_runner.run(input_ids, metadata, lora_meta)
        else:
            graphed = None if not use_graphs else self._run_mixed_graph(
                input_ids, metadata, row_lens, row_slots, windows, num_inference_tokens, errors)
            if graphed is not None:
                hidden, capture = graphed
            else:
                if windows:
                    capture = self._finetune().capture_windows(windows, num_inference_tokens,
                                                               errors)
                    if not capture.windows:  # DPO reference windows only: nothing to keep
                        capture = None
                with set_forward_context(metadata, lora_meta, finetune=capture):
                    hidden = self.model(input_ids, positions)
        if capture is not None:
            self._finetune().window_losses(capture, windows, errors)
        if windows:
            self._finetune().reference_logprobs(hidden, windows, num_inference_tokens, errors)
        return self._sampling(rows, hidden, lambda: metadata.query_start_loc[1:] - 1, result,
                              deferred, plan.continues_previous)

    def _sampling(self, rows: list[ScheduledSequence], hidden: torch.Tensor,
                  last_tokens: Callable[[], torch.Tensor], result: StepResult, deferred: bool,
                  continues_previous: bool) -> Callable[[], Callable[[], None] | None]:
        """The call that samples the rows that reached their end (`last_tokens()`: each row's
        last token's index in `hidden`, on the device) and computes prompt logprobs; see
        `_forward`."""
        def sample() -> Callable[[], None] | None:
            fill = None
            sample_rows = [i for i, r in enumerate(rows) if r.needs_sample]
            if sample_rows:
                if len(sample_rows) == len(rows) and len(hidden) == len(rows):
                    index = None  # decode rows only: row i's last token is hidden[i]
                else:
                    index = last_tokens()[to_device(sample_rows, self.device, torch.int64)]
                fill = self._sample(rows, sample_rows, hidden, index, result, deferred,
                                    continues_previous)
            else:
                self._last_sampled = self._last_sampled_host = None
            self._prompt_logprobs(rows, hidden, result)
            return fill

        return sample

    def _forward_pipelined(self, rows: list[ScheduledSequence], result: StepResult,
                           plan: BatchPlan, deferred: bool
                           ) -> Callable[[], Callable[[], None] | None]:
        """`_forward` on a pipeline stage: the rows go through in micro-batches (one per stage,
        by rows), each sent on to the next stage as soon as this one has run it, so the stages
        work on different micro-batches at once; the last stage samples them all."""
        micro = _micro_batches([r.num_scheduled_tokens for r in rows], self.pp.num_stages)
        hidden_size = self.hf_config.hidden_size
        outputs = []
        for first, end in micro:
            part = rows[first:end]
            lens = [r.num_scheduled_tokens for r in part]
            metadata = AttentionMetadata.build(
                lens, [r.num_computed_tokens for r in part], [r.block_ids for r in part],
                self.block_size, self.device)
            slots = [r.lora_slot for r in part]
            lora_meta = None
            if self.lora_manager is not None and any(slot >= 0 for slot in slots):
                lora_meta = LoRAKernelMeta.build(lens, slots, self.device)
            intermediate = None
            if not self.pp.is_first:
                shape = (sum(lens), hidden_size)
                intermediate = self.pp.recv_previous((shape, shape), self.dtype, self.device)
            input_ids = self._prepare_input_ids(part, []) if self.pp.is_first else None
            with set_forward_context(metadata, lora_meta):
                out = self.model(input_ids, metadata.positions, intermediate)
            if self.pp.is_last:
                outputs.append(out)
            else:
                if any(t.dtype != self.dtype for t in out):  # the next stage receives this dtype
                    raise RuntimeError(f"stage {self.pp.stage} would send "
                                       f"{[t.dtype for t in out]}, not {self.dtype}")
                self.pp.send_next(out)
        if not self.pp.is_last:
            return lambda: None
        hidden = torch.cat(outputs)  # every row's tokens, in row order
        ends = np.cumsum([r.num_scheduled_tokens for r in rows]) - 1
        return self._sampling(rows, hidden, lambda: to_device(ends, self.device, torch.int64),
                              result, deferred, False)

    def _run_mixed_graph(self, input_ids: torch.Tensor, metadata: AttentionMetadata,
                         row_lens: list[int], row_slots: list[int], windows: list[FinetuneWindow],
                         first_window_row: int, errors: dict[str, str]
                         ) -> tuple[torch.Tensor, GraphCapture | None] | None:
        """Replay this step's mixed-iteration graph: (hidden states, the windows' capture or
        None); None when it has no graph (eager steps: CPU, --enforce-eager, no bucket, windows
        the graph capture does not take)."""
        graphs = self.mixed_graphs
        if graphs is None:
            return None
        kept = None
        if windows:
            kept = self._finetune().graph_kept(windows, errors)
            if kept is None:
                return None
        slots = frozenset(slot for slot in row_slots if slot >= 0)
        lora_key = None
        if slots and self.lora_manager is not None:
            lora_key = tuple(not m.active_slots.isdisjoint(slots) for m in self._lora_linears)
        step = MixedStep(input_ids, metadata, np.asarray(row_lens, dtype=np.int64), row_slots,
                         lora_key, slots)
        if kept is not None:
            step.capture = (kept, None, None, None)
        key = graphs.key_for(step)
        if key is None:
            return None
        if kept is not None:
            src, dest, spans = self._finetune().admit_graph_windows(windows, first_window_row,
                                                                    errors)
            step.capture = (kept, src, dest, spans)
        return graphs.run(step, key)

    # ------------------------------------------------------------------------------ fine-tuning
    def add_finetune_job(self, job_id: str, lora_slot: int, hyperparameters: Any,
                         num_training_steps: int, init_adapter_path: str | None,
                         seed: int, resume_from: str | None = None) -> PruningPlan:
        """Set up a job's adapter (in its reserved slot), optimizer and pruning plan.
        `init_adapter_path`: a PEFT LoRA directory to start from (checked against the model).
        `resume_from`: a checkpoint directory (`save_finetune_checkpoint`); its fp32 adapter and
        AdamW state replace the init (a server-side path: allowed_adapter_dir does not apply)."""
        runner = self._finetune()
        lora = self.config.lora
        init, resume_state = None, None
        if resume_from is not None:
            init = load_peft_adapter(resume_from, target_shapes(self.hf_config),
                                     self.hf_config.num_hidden_layers, lora.max_lora_rank,
                                     None, torch.float32)
            resume_state = read_optimizer_state(resume_from)
        elif init_adapter_path is not None:
            init = load_peft_adapter(init_adapter_path, target_shapes(self.hf_config),
                                     self.hf_config.num_hidden_layers, lora.max_lora_rank,
                                     lora.allowed_dir_for(init_adapter_path), torch.float32)
        plan = runner.add_job(FinetuneJobSpec(job_id, lora_slot, hyperparameters,
                                              num_training_steps, init, seed, resume_state))
        kept = runner.job_graph_kept(job_id)
        if self.mixed_graphs is not None and kept is not None:
            # The graphs of its windows beside inference rows without adapters, now rather than
            # in its first iterations (where a capture would stall the requests decoding).
            slots = frozenset({lora_slot})
            lora_key = tuple(not m.active_slots.isdisjoint(slots) for m in self._lora_linears)
            self.mixed_graphs.precapture(lora_key, slots, kept)
        return plan

    def end_finetune_job(self, job_id: str) -> None:
        """The job stopped: drop its sequences' activations (its weights stay for `save`)."""
        if self.finetune_runner is not None:
            self.finetune_runner.end_job(job_id)

    def remove_finetune_job(self, job_id: str) -> None:
        """Forget the job: its fp32 masters, AdamW state and pruning plan go with it."""
        if self.finetune_runner is not None:
            # The activation arena and the graphs that write it stay for the next job with the
            # same plan (`ActivationArena`); one with another plan replaces them.
            self.finetune_runner.remove_job(job_id)

    def save_finetune_adapter(self, job_id: str, path: str) -> None:
        """Write a job's current adapter in PEFT format."""
        self._finetune().save_adapter(job_id, path, self.config.model.model)

    def save_finetune_checkpoint(self, job_id: str, directory: str,
                                 trainer_state: dict[str, Any]) -> None:
        """Write a job's checkpoint (adapter, AdamW state, `trainer_state`) atomically."""
        self._finetune().save_checkpoint(job_id, directory, trainer_state,
                                         self.config.model.model)

    def _finetune(self) -> FinetuneRunner:
        if self.finetune_runner is None:
            if self.lora_manager is None:
                raise ValueError("fine-tuning needs LoRA slots, and LoRA is off in this engine "
                                 "(enable_lora=False / --no-enable-lora)")
            ft = self.config.finetune
            max_finetune_len = ft.max_finetune_len or self.config.model.max_model_len
            if self.mixed_graphs is not None:
                self._arena = ActivationArena(ARENA_SEQUENCES * max_finetune_len, self.device)
            self.finetune_runner = FinetuneRunner(
                self.model, self.hf_config, self.block_size, self.device, self.dtype,
                self.lora_manager, ft.remat_threshold, ft.loss_chunk_rows, ft.remat_chains,
                activation_budget_gib=ft.activation_budget_gib,
                activation_offload=ft.activation_offload, max_finetune_len=max_finetune_len,
                batched_backward=ft.batched_backward,
                arena=self._arena, on_arena_cleared=self._drop_finetune_captures)
        return self.finetune_runner

    def _drop_finetune_captures(self) -> None:
        if self.mixed_graphs is not None:
            self.mixed_graphs.drop_captures()

    # ---------------------------------------------------------------------------------------- LoRA
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and validate an adapter into host memory (thread-safe); ValueError with reason."""
        self._lora().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        self._lora().remove(lora_int_id)

    @property
    def num_cpu_loras(self) -> int:
        return 0 if self.lora_manager is None else self.lora_manager.num_cpu_loras

    def _lora(self) -> LoRAManager:
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled in this engine (enable_lora=False / "
                             "--no-enable-lora)")
        return self.lora_manager

    def _previous_sampled_tokens(self) -> list[int]:
        """The previous plan's sampled tokens on the host. On CUDA from their copy, which was
        queued before this step's forward: reading the device tensor would wait for that."""
        if self._last_sampled_host is not None:
            return self._last_sampled_host.tolist()
        return self._last_sampled.tolist()

    def prepare_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Compile a request's constraint ahead of its steps (`StructuredOutputsExecutor`)."""
        self._grammars().compile(params)

    def _grammars(self) -> GrammarManager:
        with self._grammars_lock:  # servers prepare requests on several threads
            if self.grammars is None:
                if self._tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer")
                self.grammars = GrammarManager(self._tokenizer, self.vocab_size,
                                               self._stop_token_ids)
            return self.grammars

    def _continuation_input_ids(self, num_rows: int) -> torch.Tensor:
        """The tokens the previous plan sampled, one per row, still on the device."""
        last = self._last_sampled
        if last is None or last.shape[0] != num_rows:
            raise RuntimeError(f"a continuation plan of {num_rows} rows follows a plan that "
                               f"sampled {None if last is None else last.shape[0]} tokens")
        return last

    def _prepare_input_ids(
        self, rows: list[ScheduledSequence], windows: list[FinetuneWindow] = ()
    ) -> torch.Tensor:
        """The flat batch's token ids on the device (positions come with the metadata)."""
        chunks = [r.new_token_ids for r in rows]
        for w in windows:
            chunks.append(self._finetune().token_ids(w.job_id, w.sequence_id)[w.start:w.end])
        # Through an int64 array: one C-level pass instead of torch.tensor on a Python list.
        ids = torch.frombuffer(array.array("q", itertools.chain.from_iterable(chunks)),
                               dtype=torch.int64)
        return to_device(ids, self.device)

    def _sample(
        self,
        rows: list[ScheduledSequence],
        sample_rows: list[int],
        hidden: torch.Tensor,
        index: torch.Tensor | None,
        result: StepResult,
        deferred: bool = False,
        continues_previous: bool = False,
    ) -> Callable[[], None] | None:
        """Sample the `sample_rows` of `rows` from `hidden[index]` (None: all of `hidden`).
        `deferred` on CUDA, when only tokens are asked for: they are copied to the host without
        waiting, and the returned call waits for the copy and fills `result`."""
        logits = self.model.compute_logits(hidden if index is None else hidden[index])
        sampled_rows = rows if len(sample_rows) == len(rows) else [rows[i] for i in sample_rows]
        metadata = SamplingMetadata.build(sampled_rows, self.vocab_size, self.device)
        if self.grammars is not None or any(
                r.sampling_params.structured_outputs is not None for r in sampled_rows):
            metadata.token_bitmask = self._grammars().bitmask(
                sampled_rows, self.device,
                self._previous_sampled_tokens if continues_previous else None)
        out = self.sampler(logits, metadata)
        # A continuation plan (asynchronous scheduling) feeds these to its rows on the device.
        self._last_sampled = out.sampled_token_ids
        self._last_sampled_host = None
        sampled = result.sampled_token_ids
        if metadata.max_num_logprobs is None:
            if deferred and self.device.type == "cuda":
                host = self._last_sampled_host = HostCopy(out.sampled_token_ids)

                def fill() -> None:
                    for row, token_id in zip(sampled_rows, host.tolist()):
                        sampled[row.request_id] = token_id

                return fill
            for row, token_id in zip(sampled_rows, out.sampled_token_ids.tolist()):
                sampled[row.request_id] = token_id
            return None
        token_ids = out.sampled_token_ids.tolist()
        logprobs = out.token_logprobs()
        for k, row in enumerate(sampled_rows):
            sampled[row.request_id] = token_ids[k]
            if row.sampling_params.logprobs is not None:
                result.logprobs[row.request_id] = logprobs[k]

    def _prompt_logprobs(
        self, rows: list[ScheduledSequence], hidden: torch.Tensor, result: StepResult
    ) -> None:
        """Logprobs of prompt tokens covered by this step (logits at p score the token at p+1)."""
        starts = None
        for i, row in enumerate(rows):
            num_top = row.sampling_params.prompt_logprobs
            num_prompt = len(row.prompt_token_ids)
            first = row.num_computed_tokens
            if num_top is None or first >= num_prompt:
                continue
            if starts is None:
                starts = [0]
                for r in rows:
                    starts.append(starts[-1] + r.num_scheduled_tokens)
            stop = min(first + row.num_scheduled_tokens, num_prompt - 1)
            entries: list[TokenLogprobs | None] = [None] if first == 0 else []
            if stop > first:
                flat = torch.arange(starts[i], starts[i] + stop - first, device=self.device)
                targets = torch.tensor(row.prompt_token_ids[first + 1 : stop + 1], device=self.device)
                logits = self.model.compute_logits(hidden[flat])
                tensors = compute_prompt_logprobs(logits, targets, num_top)
                entries.extend(to_token_logprobs(tensors, num_top))
            result.prompt_logprobs[row.request_id] = entries

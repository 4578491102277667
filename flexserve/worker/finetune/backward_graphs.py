"""Layer-wise backward windows as CUDA graphs, split at attention (FlexLLM appendix D's static
reservation; the piecewise split vLLM uses for mixed batches).

One backward window runs one layer's ~20 ops of a few kernels each. Launched one by one from
Python they cost milliseconds of host time whatever the window's length, most of a window's cost
at co-serving sizes. Here a job's layer backward is captured per (layer, row bucket) as two graphs
around the attention op, which runs eagerly between them because its keys [0, end) move with the
window:

- the top piece: the backward of the ops after attention (the MLP, both residual adds, o_proj),
  from dL/d(layer output) to dL/d(attention output), which it copies into a static buffer;
- attention, eager (`SequenceBackward.attention_gradients`): the window's attention over keys
  [0, end) recomputed from the paged KV cache under autograd, its dK, dV summed into the
  sequence's KV-gradient accumulators; dQ and the window's rows of dK, dV go into static buffers;
- the bottom piece: rope, the q/k/v projections and the input norm, to dL/dx, which it leaves in
  the static residual rows; they are copied back into the sequence's residual-gradient buffer.

The pieces run `SequenceBackward.walk` on a gathered `_Window`: its stored tensors are rows of the
activation arena picked by a static index, its rotary angles those of static positions. Static
buffers (`BackwardBuffers`) are shared by every job, as windows run one at a time. A window of n
rows replays the smallest bucket N >= n: rows [n, N) of the inputs are zero and their index and
position repeat row n - 1, so they add exactly nothing (zero gradients times finite activations:
the arena starts zeroed) to the LoRA gradients, and their outputs are not copied back. The pieces
read the LoRA weights and scaling of the staging slot and add into gradient buffers of their own
(`LoRAManager.staging_slot`): a window's job has its layer's weights copied there first and the
gradients added into its own after, so one set of graphs serves every job of a plan, in whichever
slot it runs. On CPU (tests) the same padded pieces run eagerly.

Windows of several jobs of the plan run as one too (MuxTune's batched backward): `run_many`
stacks their rows, stages the jobs' adapters side by side (`StagedLoRA`: each row's LoRA math on
its own job's block) and replays the pieces for up to `MAX_BATCHED_JOBS` jobs (captured with
`prepare_batched` once a second job of the plan runs), so the frozen GEMMs of a layer run once
over every job's rows.

A layer whose pieces need what a gathered window cannot give (a tensor the plan leaves in the KV
cache or recomputes from attention, LoRA dropout masks) runs eagerly, as do windows longer than
the largest bucket and sequences whose activations are not in the arena.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from flexserve.worker.finetune.activation_arena import ActivationArena
from flexserve.worker.finetune.layer_backward import (
    SequenceBackward,
    WindowUnsupported,
    _Window,
)
from flexserve.worker.finetune.staged_lora import StagedLoRA
from flexserve.worker.safe_capture import CaptureFailed, capture

logger = logging.getLogger(__name__)

# Row buckets of captured windows. Windows up to 4096 rows are host-bound enough to gain (a
# backward window's fixed cost is of the order of a 4096-row window's GEMMs); longer ones run
# eagerly. The graphs' private memory is the largest bucket's working set, shared by all.
BACKWARD_GRAPH_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
# Jobs whose windows the batched pieces run as one: their LoRA products are this many rank
# blocks wide (a row keeps its own; fewer jobs leave blocks zero). One set of pieces, captured
# when a plan's second job starts: a capture of a plan's pieces takes seconds (H200,
# Llama-3.1-8B, all projections: 3-4 s), and the wider LoRA products read the same operands.
MAX_BATCHED_JOBS = 8


def backward_buckets(max_rows: int) -> tuple[int, ...]:
    """The buckets for windows of at most `max_rows` rows: the standard ones below it, then
    `max_rows` itself (capped at the largest standard bucket)."""
    top = min(max_rows, BACKWARD_GRAPH_BUCKETS[-1])
    return tuple(b for b in BACKWARD_GRAPH_BUCKETS if b < top) + (top,)


class BackwardBuffers:
    """The static inputs and outputs of captured backward pieces, for windows of up to
    `max_rows` rows: residual rows (fp32 [rows, hidden]: dL/d output in, dL/dx out), the
    attention output's and inputs' gradients (fp32, by tensor name), the gather index and
    positions of the window's rows."""

    def __init__(self, max_rows: int, hidden_size: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.device = device
        self.rows = torch.zeros(max_rows, hidden_size, device=device)
        self.index = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._arange = torch.arange(max_rows, device=device)
        self._grads: dict[str, torch.Tensor] = {}
        # rows of each buffer that may hold a window's values past the next window's own rows
        self._dirty: dict[str, int] = {}

    def grad(self, name: str, width: int) -> torch.Tensor:
        """The static fp32 [max_rows, width] gradient buffer of tensor `name`."""
        t = self._grads.get(name)
        if t is None:
            t = torch.zeros(self.max_rows, width, device=self.device)
            self._grads[name] = t
        elif t.shape[1] != width:
            raise ValueError(f"static gradient {name!r} is [{t.shape[1]}] wide, not [{width}]")
        return t

    def load_windows(self, windows: list[tuple[int, int, torch.Tensor]], bucket: int) -> None:
        """Inputs of windows (arena row, position, residual rows) stacked in order from row 0,
        padded to `bucket` rows (padding repeats the last row's index and position)."""
        offset = 0
        for base, start, residual in windows:
            n = residual.shape[0]
            arange = self._arange[:n]
            torch.add(arange, base, out=self.index[offset:offset + n])
            torch.add(arange, start, out=self.positions[offset:offset + n])
            self.rows[offset:offset + n].copy_(residual)
            offset += n
        self.index[offset:bucket] = self.index[offset - 1]
        self.positions[offset:bucket] = self.positions[offset - 1]
        self._zero_tail("rows", self.rows, offset)

    def load_gradient(self, name: str, value: torch.Tensor, offset: int, total: int) -> None:
        """Rows [offset, offset + len(value)) of static gradient `name` from `value` (widened to
        fp32, exactly), in a load of windows of `total` rows."""
        t = self._grads[name]
        t[offset:offset + value.shape[0]].copy_(value)
        if offset + value.shape[0] == total:
            self._zero_tail(name, t, total)

    def clear(self) -> None:
        """Zero every buffer (before an eager warm-up that must add nothing)."""
        for t in (self.rows, self.index, self.positions, *self._grads.values()):
            t.zero_()
        self._dirty.clear()

    def _zero_tail(self, name: str, t: torch.Tensor, n: int) -> None:
        # Rows [n, dirty) hold an earlier, longer window's values; rows a window padded stay
        # zero (the pieces turn zero gradients into zero gradients).
        dirty = self._dirty.get(name, 0)
        if dirty > n:
            t[n:dirty].zero_()
        self._dirty[name] = n


@dataclass(slots=True)
class _Graphs:
    top: torch.cuda.CUDAGraph
    bottom: torch.cuda.CUDAGraph | None  # None: nothing below attention has a gradient


@dataclass(slots=True)
class _Batched:
    """The pieces of several jobs' windows as one: a template on staged adapters, its graphs."""
    template: SequenceBackward
    graphs: dict[tuple[int, int], _Graphs]


class BackwardGraphs:
    """The layer backward of the jobs of one plan as captured pieces, per (layer, bucket).

    `template` is a `SequenceBackward` of the plan on the staging slot with gradient buffers of
    its own (the pieces read only what all of a job's sequences share: its plan, LoRA weights,
    gradient buffers and the model; `run_many` stages a job's weights and gradients). On CUDA
    `capture` records the graphs (call it between iterations); elsewhere `run` executes the same
    padded pieces eagerly."""

    def __init__(self, template: SequenceBackward, arena: ActivationArena,
                 buffers: BackwardBuffers, pool: Any = None,
                 use_graphs: bool | None = None) -> None:
        self.template = template
        self.arena = arena
        self.buffers = buffers
        self.pool = pool  # CUDA graph memory pool (shared by the runner's backward graphs)
        self.buckets = backward_buckets(buffers.max_rows)
        # CUDA graphs on CUDA (False there runs the padded pieces eagerly, for tests)
        self.use_graphs = buffers.device.type == "cuda" if use_graphs is None else use_graphs
        graph = template.graph
        self._attention = template.attention_op
        ops = list(reversed(graph.ops))
        cut = ops.index(self._attention)
        self._top_ops, self._bottom_ops = ops[:cut], ops[cut + 1:]
        self._widths = {name: graph.tensors[name].width
                        for name in (self._attention.outputs[0], *self._attention.inputs)}
        self._graphs: dict[tuple[int, int], _Graphs] = {}
        self._batched: _Batched | None = None  # `prepare_batched`
        self._eager_layers: set[int] = set()  # layers whose pieces cannot run gathered
        self.capture_failed = False  # a capture failed: the windows run eagerly

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def runs(self, owner: SequenceBackward, layer: int, n: int) -> bool:
        """Whether `run` takes this window: its rows are in the arena, it fits a bucket, its
        layer runs gathered (and, on CUDA, was captured)."""
        bucket = self.bucket(n)
        if (bucket is None or layer in self._eager_layers or owner.store.arena is not self.arena
                or owner.store.stored_names != self.template.store.stored_names):
            return False
        return not self.use_graphs or (layer, bucket) in self._graphs

    @property
    def max_jobs(self) -> int:
        """How many jobs' windows `run_many` takes as one."""
        return 1 if self._batched is None else MAX_BATCHED_JOBS

    def prepare(self) -> int:
        """Find the layers whose pieces run gathered and, on CUDA, capture every (layer,
        bucket), largest buckets first (their private memory is then reused by the smaller
        ones); returns the number of graphs. Each capture follows an eager warm-up with zeroed
        inputs, which adds exactly zero to the job's gradients. Call between iterations."""
        return self._capture(self.template, self._graphs, find_eager=True)

    def prepare_batched(self, template: SequenceBackward) -> int:
        """The pieces of up to `MAX_BATCHED_JOBS` jobs' windows as one: `template` is a
        `SequenceBackward` of the plan like `self.template` (its own gradient buffers, which it
        does not use); its LoRA math reads adapters staged side by side. Captured on CUDA like
        `prepare`'s (call it after `prepare`, once, between iterations); returns the number of
        graphs."""
        if self._batched is not None:
            raise ValueError("the batched pieces are prepared already")
        if template.store.lora_dropout > 0:
            raise ValueError("adapters with dropout run their windows one job at a time")
        modules = {target: template.lora_parts(0, target)[0] for target in template.graph.bypass}
        first = next(iter(modules.values()))
        template.staged = StagedLoRA(
            MAX_BATCHED_JOBS, template.lora_parts(0, next(iter(modules)))[1],
            {target: (m.in_features, m.out_features) for target, m in modules.items()},
            self.buffers.max_rows, first.lora_a.dtype, self.buffers.device)
        graphs: dict[tuple[int, int], _Graphs] = {}
        count = self._capture(template, graphs, find_eager=False)
        if not self.capture_failed:
            self._batched = _Batched(template, graphs)
        return count

    def _capture(self, template: SequenceBackward, graphs: dict[tuple[int, int], _Graphs],
                 find_eager: bool) -> int:
        count = 0
        buckets = reversed(self.buckets) if self.use_graphs else self.buckets[:1]
        for bucket in buckets:
            for layer in range(template.store.num_layers):
                if layer in self._eager_layers:
                    continue
                try:
                    self.buffers.clear()
                    self._pieces(template, layer, bucket, eager=True)
                except WindowUnsupported as e:
                    if not find_eager:
                        raise
                    logger.info("backward windows of layer %d run eagerly: %s", layer, e)
                    self._eager_layers.add(layer)
                    continue
                if not self.use_graphs:
                    continue
                top = torch.cuda.CUDAGraph()
                bottom = torch.cuda.CUDAGraph() if self._has_bottom(layer) else None
                try:
                    self._pieces(template, layer, bucket, eager=False, graphs=(top, bottom))
                except CaptureFailed as e:
                    # The same pieces run eagerly, padded to their buckets.
                    logger.warning("backward windows run without CUDA graphs: %s", e)
                    self._graphs.clear()
                    self._batched = None
                    self.use_graphs = False
                    self.capture_failed = True  # its pool takes no more captures
                    self.buffers.clear()
                    return 0
                graphs[(layer, bucket)] = _Graphs(top, bottom)
                count += 1 + (bottom is not None)
        self.buffers.clear()
        return count

    def run(self, owner: SequenceBackward, layer: int, start: int, end: int) -> None:
        """Backward window [start, end) of `layer` of `owner`'s sequence (`runs` said yes)."""
        self.run_many(layer, [(owner, start, end)])

    def run_many(self, layer: int, windows: list[tuple[SequenceBackward, int, int]]) -> None:
        """Backward windows (owner, start, end) of `layer` of several sequences as one: their
        rows stacked, the pieces' row-wise work (MLP, projections, norms, rope and every GEMM
        with the frozen weights) run once over all of them, the attention of each window on its
        own sequence; the LoRA gradients add up over the rows as over the windows one by one.
        Windows of one job run on the staging slot; of several jobs (at most `max_jobs`, each
        in its own LoRA slot), on their adapters staged side by side, each job's gradients its
        own rows' sums. Every window must be one `runs` accepts, their rows together one
        bucket."""
        total = sum(end - start for _, start, end in windows)
        bucket, b = self.bucket(total), self.buffers
        owners = {}  # LoRA slot (the job) -> its first window's sequence, in window order
        for owner, _, _ in windows:
            owners.setdefault(owner.lora_slot, owner)
        if len(owners) > 1:  # each job's rows contiguous (one segment of the LoRA kernels' routing)
            order = list(owners)
            windows = sorted(windows, key=lambda w: order.index(w[0].lora_slot))
        staged = None
        if len(owners) == 1:
            template, graphs = self.template, self._graphs
            self._stage_weights(windows[0][0], layer)
        else:
            template, graphs = self._batched.template, self._batched.graphs
            staged = template.staged
            slots = list(owners)
            staged.load(slots, [(slots.index(owner.lora_slot), end - start)
                                for owner, start, end in windows], bucket)
        b.load_windows([(owner.store.arena_base + start, start, owner.residual_grad[start:end])
                        for owner, start, end in windows], bucket)

        def attend() -> None:
            offset = 0
            for owner, start, end in windows:
                self._attend(owner, layer, start, end, offset, total)
                offset += end - start

        if self.use_graphs:
            pieces = graphs[(layer, bucket)]
            pieces.top.replay()
            attend()
            if pieces.bottom is not None:
                pieces.bottom.replay()
        else:
            self._pieces(template, layer, bucket, eager=True, between=attend)
        offset = 0
        for seq, start, end in windows:
            seq.residual_grad[start:end].copy_(b.rows[offset:offset + end - start])
            offset += end - start
        if staged is None:
            self._unstage_gradients(windows[0][0], layer)
        else:
            staged.unstage([{target: owner.lora_parts(layer, target)[2:]
                             for target in template.graph.bypass}
                            for owner in owners.values()])

    def _stage_weights(self, owner: SequenceBackward, layer: int) -> None:
        """The layer's LoRA weights and scaling of `owner`'s job into the staging slot, which
        the pieces read."""
        staging, slot = self.template.lora_slot, owner.lora_slot
        dst, src = [], []
        for target in self.template.graph.bypass:
            module, rank, _, _ = self.template.lora_parts(layer, target)
            dst += [module.lora_a[staging, :rank], module.lora_b[staging, :, :rank],
                    module.scaling[staging:staging + 1]]
            src += [module.lora_a[slot, :rank], module.lora_b[slot, :, :rank],
                    module.scaling[slot:slot + 1]]
        torch._foreach_copy_(dst, src)

    def _unstage_gradients(self, owner: SequenceBackward, layer: int) -> None:
        """The LoRA gradients the pieces added into their own buffers, added into `owner`'s
        job's (and the pieces' zeroed for the next window)."""
        staged, own = [], []
        for target in self.template.graph.bypass:
            _, _, grad_a, grad_b = self.template.lora_parts(layer, target)
            _, _, own_a, own_b = owner.lora_parts(layer, target)
            staged += [grad_a, grad_b]
            own += [own_a, own_b]
        torch._foreach_add_(own, staged)
        torch._foreach_zero_(staged)

    def _has_bottom(self, layer: int) -> bool:
        """Whether the bottom piece does anything: attention's output or the layer's input
        needs a gradient (else, in a bottom layer that trains only its MLP, it is empty)."""
        return any(self.template.needs_gradient(layer, name)
                   for name in (self._attention.outputs[0], "x"))

    def _attend(self, owner: SequenceBackward, layer: int, start: int, end: int, offset: int,
                total: int) -> None:
        b, n = self.buffers, end - start
        out = self._attention.outputs[0]
        if not owner.needs_gradient(layer, out):
            return  # nothing below attention trains in this layer: its backward is skipped
        grad = b.grad(out, self._widths[out])[offset:offset + n]
        for name, value in owner.attention_gradients(layer, start, end, grad).items():
            b.load_gradient(name, value, offset, total)

    def _pieces(self, template: SequenceBackward, layer: int, bucket: int, eager: bool,
                graphs: tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph | None] | None = None,
                between: Any = None) -> None:
        """The two pieces of (layer, bucket) of `template`: run (`eager`) or captured into
        `graphs`; `between` runs between them (the eager attention)."""
        b = self.buffers
        rows = b.rows[:bucket]
        out = self._attention.outputs[0]
        attn_grad = b.grad(out, self._widths[out])[:bucket]
        statics = {name: b.grad(name, self._widths[name])[:bucket]
                   for name in self._attention.inputs}
        staged = template.staged
        has_bottom = self._has_bottom(layer)
        # Everything the graphs read is made inside them (the window's rotary angles and
        # gathered rows) or is static: a tensor made outside a capture and dropped after it
        # would be memory the graph reads but nobody owns.
        state: dict[str, Any] = {}
        with torch.no_grad():
            def top() -> None:
                if staged is not None:  # the jobs' adapters, and what enters the window
                    staged.gather({target: template.lora_parts(layer, target)[0]
                                   for target in template.graph.bypass})
                    staged.admit(rows, b.index[:bucket], self.arena.dump_row)
                win = _Window(template, layer, 0, bucket, rows=b.index[:bucket],
                              positions=b.positions[:bucket], arena=self.arena)
                grads = template.window_gradients(layer, rows)
                state.update(win=win, grads=grads)
                template.walk(win, grads, self._top_ops, rows)
                grad = grads.values.get(out)
                if grad is None:
                    attn_grad.zero_()
                else:
                    attn_grad.copy_(grad)
                if staged is not None and not has_bottom:
                    staged.mark_nonfinite(rows)
                    staged.mark_nonfinite(attn_grad)
                    staged.seal()

            def bottom() -> None:
                win, grads = state["win"], state["grads"]
                grads.drop(out)
                win.release(template.dead_after(self._attention), attention=True)
                for name, static in statics.items():
                    if staged is not None:
                        staged.admit(static)
                    grads.give(name, static)
                template.walk(win, grads, self._bottom_ops, rows)
                template.finish_window(grads, rows)
                if staged is not None and has_bottom:
                    staged.mark_nonfinite(rows)
                    staged.seal()

            if eager:
                top()
                if between is not None:
                    between()
                bottom()
                return
            capture(graphs[0], self.pool, top, self.buffers.device)
            if graphs[1] is not None:
                capture(graphs[1], self.pool, bottom, self.buffers.device)

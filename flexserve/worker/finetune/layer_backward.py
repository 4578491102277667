"""Layer-wise backward of one fine-tuning sequence, window by window (FlexLLM algorithm 2, 12-21).

Layers go from the top down; inside a layer, windows go from the end of the sequence to the start,
of any sizes. Backward window [start, end) of layer n:

1. reads dL/dx_next of its rows from the sequence's residual-gradient buffer (the window loss
   wrote the top layer's, layer n + 1 wrote the others);
2. runs the manual backward of the ops of the layer graph (`flexserve.peft.layer_graph`) in
   reverse, reading the tensors the pruning plan stored and rematerializing the others from their
   producer ops; frozen linears give dX only, LoRA ops also dA and dB;
3. attention: recomputes the window's queries over keys [0, end) from the paged KV cache under
   autograd (SDPA with K/V in their KV heads, `window_attention`: a fused flash
   kernel on GPU without a GQA-expanded K/V copy; math on CPU, expanded), which gives dQ of the
   window and dK, dV of all positions [0, end). Those go into the layer's KV-gradient accumulator;
   the window's own dK, dV are then the accumulator's rows [start, end), complete because every
   later window has already added its share;
4. writes dL/dx of its rows into the residual buffer, for layer n - 1.

After a layer's last window (start == 0) the accumulator is zeroed for the layer below and the
layer's stored activations are freed. Any split gives whole-sequence backprop's gradients.

Precision: activations and frozen weights in the model's dtype (GEMMs run in it); gradients, the
residual buffer, the accumulators and the LoRA math in fp32. In windows of at least
`WIDE_LORA_GEMM_ROWS` rows the LoRA products that read a 16-bit activation have fp32 sums and
outputs without widened copies (`mm_fp32`: on CUDA one 16-bit GEMM): the LoRA A
rematerialization exactly so; in a bf16 model dA and the bypass's dX take dS as two bf16 terms
(`split_bf16`, within 2^-17 of it); and a frozen linear whose LoRA A reads its input adds the
bypass's fp32 dX in its own dX GEMM's epilogue (`addmm_fp32`, one rounding). Narrower windows
widen the operands and round the frozen product before the sum. Both paths do the same, so they
compute the same values.

Where `use_triton` says so (CUDA), the elementwise backward is fused Triton kernels with the
torch path's fp32 math (`backward_ops`). The fused path also drops temporaries without changing a
value: a dX GEMM's model-dtype product is kept as is (it is the gradient's exact value; readers
widen it), and sums go in place only into buffers the window allocated (`WindowGradients`).
In a bf16 or fp32 model the backward of an adapter with dropout runs its LoRA A op as fused LoRA
training kernels there (`fused_lora_a_backward`): dA and dX's LoRA term, dropout' applied with the
mask regenerated from its hash in registers, with the same precision as above (dS as two 16-bit
halves). That dX term reaches the frozen linear's dX GEMM epilogue, as the bypass's dX does
without dropout, and the dropout op's own backward has nothing left to do. LoRA A's output S,
where the plan rematerializes it, is fused LoRA kernel 1 over the dropout's input, as in the
forward (`fused_lora_dropout_shrink`): the mask is never built as a tensor there either. Without dropout the
LoRA A op runs on the same kernels, and LoRA B's op (dB and dS, fp32) on fused LoRA kernel 3
(`fused_lora_b_backward`), in the window and output sizes where they were measured faster than
the torch GEMMs (`lora_kernel_paths`, the configs' `engine_lora_backward`; docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from flexserve.distributed.parallel_state import TensorParallelGroup
from flexserve.layers.lora_linear import LoRALinear
from flexserve.layers.rotary import rotate
from flexserve.peft.bypass import TARGET_MODULES, target_shapes
from flexserve.peft.layer_graph import LayerGraph, Op
from flexserve.worker.finetune.activation_arena import ActivationArena
from flexserve.worker.finetune.activation_store import (
    ActivationStore,
    apply_lora_dropout,
    dropout_window_seed,
)
from flexserve.worker.finetune.backward_gradients import WindowGradients
from flexserve.worker.finetune.backward_ops import (
    addmm_fp32,
    fused_lora_a_backward,
    fused_lora_b_backward,
    fused_lora_dropout_shrink,
    fused_rope_backward,
    fused_silu_mul_backward,
    mm_fp32,
    rmsnorm_backward,
    rmsnorm_forward,
    rope_backward,
    silu_mul_backward,
    split_bf16,
    window_attention,
)
from flexserve.worker.finetune.staged_lora import StagedLoRA
from flexserve_kernels.dispatch import use_triton
from flexserve_kernels.lora.serve.ops import MAX_WINDOW_RANK, lora_shrink_fused
from flexserve_kernels.lora.train.configs import train_configs

# Windows of at least this many rows run the torch path's LoRA products as 16-bit GEMMs with fp32
# outputs. In device time (Llama-3.1-8B, r=16, H200, graph replays; docs/benchmarks.md, "LoRA
# backward of a window") they match the widened fp32 GEMMs at 16-64 rows and are faster from 256
# (down_proj's LoRA A op with its dX GEMM: 85.8 vs 103.1 us at 256 rows, 885.6 vs 1225.9 at
# 4096), but they launch more kernels, which eager windows pay on the host. Where Triton runs,
# windows below 2048 rows take the fused LoRA kernels instead (`lora_kernel_paths`).
WIDE_LORA_GEMM_ROWS = 1024


# Model dtypes in which the backward runs LoRA ops as the fused LoRA kernels where `use_triton`
# (fp16's narrow exponent range cannot hold dS's two-halves split: fp16 models keep the torch path).
LORA_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def lora_kernels_fit(dtype: torch.dtype, rank: int) -> bool:
    """Whether the backward's fused LoRA kernels take an adapter of `rank` in a model of `dtype`:
    a dtype of LORA_KERNEL_DTYPES and a rank their tiles serve (MAX_WINDOW_RANK, kernel 1's
    widest accumulator and the configs' largest rank)."""
    return dtype in LORA_KERNEL_DTYPES and rank <= MAX_WINDOW_RANK


# The outputs of row-parallel projections: under tensor parallelism a rank computes a partial
# sum of them.
ROW_PARALLEL_OUTPUTS = ("o_out", "down_out")


def lora_grad_name(layer: int, target: str, half: str) -> str:
    """PEFT's saved name of a LoRA tensor; half is "A" or "B"."""
    parent = TARGET_MODULES[target]
    return f"base_model.model.model.layers.{layer}.{parent}.{target}.lora_{half}.weight"


def lora_grad_buffers(
    graph: LayerGraph, hf_config: Any, num_layers: int, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """Zeroed fp32 gradients, by PEFT name, of every LoRA tensor `graph` trains in each layer."""
    shapes = target_shapes(hf_config)
    grads = {}
    for layer in range(num_layers):
        for target, kind in graph.bypass.items():
            if kind == "lora":
                rank = graph.tensors[f"{target}_s"].width
                n_in, n_out = shapes[target]
                grads[lora_grad_name(layer, target, "A")] = torch.zeros(rank, n_in, device=device)
                grads[lora_grad_name(layer, target, "B")] = torch.zeros(n_out, rank, device=device)
    return grads


def backward_reads(op: Op) -> tuple[str, ...]:
    """The forward tensors the backward of `op` reads besides gradients and weights (dropout
    reads its mask, which the store regenerates or unpacks; attention's K/V are in the cache)."""
    if op.kind in ("rmsnorm", "silu_mul", "lora_a", "lora_b", "attention"):
        return op.inputs
    return ()


def grads_needed(graph: LayerGraph, input_grad: bool) -> dict[str, bool]:
    """Per tensor: whether backward needs dL/dtensor (for a trainable op it feeds, or for the
    layer input's gradient when `input_grad`; the bottom layer's input needs none)."""
    needed = {"x": input_grad}
    for op in graph.ops:
        flag = bool(op.trainable) or any(needed.get(name, False) for name in op.inputs)
        for name in op.outputs:
            needed[name] = flag
    return needed


def check_plan(graph: LayerGraph, store: ActivationStore) -> None:
    """ValueError unless, in every layer, each tensor the backward reads is stored, in the KV
    cache, or can be rematerialized from those through its producer ops (dropout masks can
    always be: they are regenerated when not kept)."""
    if any(kind != "lora" for kind in graph.bypass.values()):
        raise ValueError("the layer-wise backward trains LoRA bypasses only, not "
                         f"{sorted(set(graph.bypass.values()) - {'lora'})}")
    for layer in range(store.num_layers):
        kept = store.stored_names[layer] | store.kv_cache_names
        memo: dict[str, bool] = {}

        def available(name: str, memo: dict[str, bool] = memo, kept: set[str] = kept) -> bool:
            if name not in memo:
                memo[name] = False  # a cycle cannot make itself available
                producer = graph.producer(name)
                memo[name] = name in kept or (
                    producer is not None and all(available(i) for i in producer.inputs))
            return memo[name]

        needed = grads_needed(graph, input_grad=layer > 0)
        for op in graph.ops:
            if any(needed[name] for name in op.outputs):
                missing = [name for name in backward_reads(op) if not available(name)]
                if missing:
                    raise ValueError(f"layer {layer}: the backward of {op.name} reads {missing}, "
                                     "which the plan neither stores nor can rematerialize")


class SequenceBackward:
    """The backward of one fine-tuning sequence, driven window by window.

    Create it with the sequence's `ActivationStore` when its first forward window is scheduled:
    the window loss writes into `residual_grad`. `block_ids` is the sequence's KV block table,
    `lora_slot` the slot its adapter had in the forward (weights and scaling are read from
    there), and `grads` maps PEFT names (`lora_grad_name`) to fp32 buffers into which this adds
    the adapter gradients (e.g. `lora_grad_buffers`, or an optimizer's gradient buffers).
    """

    def __init__(
        self, model: Any, store: ActivationStore, num_tokens: int, block_ids: list[int],
        block_size: int, lora_slot: int, grads: Mapping[str, torch.Tensor],
    ) -> None:
        layers = model.model.layers
        if store.num_layers != len(layers):
            raise ValueError(f"the store has {store.num_layers} layers, the model {len(layers)}")
        if not 1 <= num_tokens <= store.max_len:
            raise ValueError(f"num_tokens {num_tokens} must be in [1, {store.max_len}]")
        if len(block_ids) * block_size < num_tokens:
            raise ValueError(f"{len(block_ids)} blocks of {block_size} cannot hold {num_tokens}")
        check_plan(store.graph, store)
        self.model = model
        self.tp = getattr(model, "tp", None) or TensorParallelGroup()
        self.store = store
        self.graph = store.graph
        self.num_tokens = num_tokens
        self.lora_slot = lora_slot
        attn = layers[0].self_attn.attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scale = attn.head_dim, attn.scale
        device, max_len = store.device, store.max_len
        self.residual_grad = torch.zeros(max_len, model.config.hidden_size, device=device)
        self.key_grad = torch.zeros(max_len, self.num_kv_heads, self.head_dim, device=device)
        self.value_grad = torch.zeros_like(self.key_grad)
        positions = torch.arange(num_tokens)
        table = torch.tensor(block_ids, dtype=torch.int64)
        self._kv_slots = (table[positions // block_size] * block_size
                          + positions % block_size).to(device)
        self._needed = (grads_needed(self.graph, False), grads_needed(self.graph, True))
        # Tensors whose one reader's backward gives one gradient, consumed only by their
        # producer, a frozen linear: name -> that linear's target.
        readers = [name for op in self.graph.ops for name in op.inputs]
        producers = {name: self.graph.producer(name) for name in self.graph.tensors}
        self._gemm_only = {name: op.name.split(".")[0] for name, op in producers.items()
                           if op is not None and op.kind == "linear" and readers.count(name) == 1}
        # Op -> the forward tensors a window may drop once that op's backward has run: those
        # whose first reader it is. Every later reader's backward (and every rematerialization
        # from them, which serves later ops) has run before it in the reverse walk.
        first_reader: dict[str, str] = {}
        for op in self.graph.ops:
            for name in op.inputs:
                first_reader.setdefault(name, op.name)
        self._dead_after = {op.name: tuple(n for n, r in first_reader.items() if r == op.name)
                            for op in self.graph.ops}
        # Frozen linears whose LoRA A reads their own input (no dropout between): the bypass's
        # dX arrives first in the reverse walk, in fp32, and the linear's dX GEMM adds it.
        self._adds_bypass_dx = {
            op.name for op in self.graph.ops if op.kind == "linear"
            and any(o.kind == "lora_a" and o.inputs == op.inputs
                    and o.name.split(".")[0] == op.name.split(".")[0] for o in self.graph.ops)}
        # The fused LoRA kernels (bf16 or fp32 models where `use_triton`; `_Window.lora_kernels`):
        # target -> the input of its dropout op, which they read and give the bypass's dX to (the
        # frozen linear's input, whose dX GEMM then adds it, as above).
        self._dropout_input = {op.name.split(".")[0]: op.inputs[0] for op in self.graph.ops
                               if op.kind == "dropout"}
        fused_adds = {  # (with dropout, no LoRA A reads a linear's own input)
            op.name for op in self.graph.ops if op.kind == "linear"
            and self._dropout_input.get(op.name.split(".")[0]) == op.inputs[0]}
        self._adds_fused_bypass_dx = fused_adds | self._adds_bypass_dx
        self._kernel_limits: dict[str, int] | None = None
        self._lora: dict[tuple[int, str], tuple[LoRALinear, int, torch.Tensor, torch.Tensor]] = {}
        for layer in range(len(layers)):
            for target in self.graph.bypass:
                module = self.linear(layer, target)
                rank = self.graph.tensors[f"{target}_s"].width
                if not isinstance(module, LoRALinear) or not 0 <= lora_slot < module.max_loras:
                    raise ValueError(f"layer {layer} {target} has no LoRA slot {lora_slot}")
                if rank > module.max_rank:
                    raise ValueError(f"rank {rank} exceeds the slots' max rank {module.max_rank}")
                pair = []
                for half, shape in (("A", (rank, module.in_features)),
                                    ("B", (module.out_features, rank))):
                    grad = grads.get(lora_grad_name(layer, target, half))
                    if grad is None or tuple(grad.shape) != shape or grad.dtype != torch.float32:
                        raise ValueError(f"grads needs an fp32 {list(shape)} tensor named "
                                         f"{lora_grad_name(layer, target, half)}")
                    pair.append(grad)
                self._lora[(layer, target)] = (module, rank, pair[0], pair[1])
        self._lora_kernels_fit = lora_kernels_fit(store.dtype, max((v[1] for v in self._lora.values()), default=0))
        # The rank-r shrinks of the adapters (LoRA A's outputs)
        self._shrinks = {op.outputs[0] for op in self.graph.ops if op.kind == "lora_a"}
        # Set on a template of several jobs' windows (`BackwardGraphs`): the LoRA math reads
        # their staged adapters and routes each row to its own (`StagedLoRA`).
        self.staged: StagedLoRA | None = None
        self.layer = len(layers) - 1  # the layer the next backward window belongs to
        self.window_end = num_tokens  # where the next backward window ends
        # Windows `graphs.runs` accepts go through `graphs.run` (`BackwardGraphs`: the layer's
        # backward as captured pieces around an eager attention); the others run here.
        self.graphs: Any = None

    @property
    def done(self) -> bool:
        """Whether every layer's backward has run (the KV blocks may be freed)."""
        return self.layer < 0

    def linear(self, layer: int, target: str) -> torch.nn.Module:
        decoder = self.model.model.layers[layer]
        return getattr(getattr(decoder, TARGET_MODULES[target]), target)

    def backward_window(self, layer: int, start: int, end: int) -> bool:
        """Backward of positions [start, end) of `layer`. Layers from the top, windows from the
        end of the sequence to its start; ValueError for any other order. True when it ran as
        `graphs`' pieces, False when eagerly."""
        self.begin_window(layer, start, end)
        with torch.no_grad():
            pieces = self.graphs is not None and self.graphs.runs(self, layer, end - start)
            if pieces:
                self.graphs.run(self, layer, start, end)
            else:
                self._run_window(_Window(self, layer, start, end))
        self.end_window(layer, start)
        return pieces

    def begin_window(self, layer: int, start: int, end: int) -> None:
        """Check that [start, end) of `layer` is this sequence's next backward window
        (ValueError otherwise) and bring its stored rows back if they were offloaded."""
        if self.done:
            raise ValueError("the backward of this sequence is complete")
        if self.store.num_forward_tokens != self.num_tokens:
            raise ValueError(f"the forward has covered {self.store.num_forward_tokens} of "
                             f"{self.num_tokens} tokens; the backward starts after it")
        if layer != self.layer:
            raise ValueError(f"backward window for layer {layer}, but the backward is at layer "
                             f"{self.layer} (layers go from the top down)")
        if end != self.window_end or not 0 <= start < end:
            raise ValueError(f"backward window [{start}, {end}) of layer {layer} is out of order: "
                             f"the next one ends at {self.window_end} and is not empty")
        self.store.prepare_layer(layer)  # offloaded rows come back (the next ones start to)

    def end_window(self, layer: int, start: int) -> None:
        """After the window that starts at `start` ran: the next one ends there, or, at the
        layer's first token, the layer's state goes and the layer below is next."""
        self.window_end = start
        if start == 0:
            self.key_grad[:self.num_tokens].zero_()
            self.value_grad[:self.num_tokens].zero_()
            self.store.free_layer(layer)
            self.layer -= 1
            self.window_end = self.num_tokens

    def cached_kv(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K (after rope) and V of positions [0, end) from the paged cache: [end, KV, D] each."""
        cache = self.model.model.layers[layer].self_attn.attn.kv_cache
        slots = self._kv_slots[:end]
        shape = (-1, self.num_kv_heads, self.head_dim)
        return (cache[0].reshape(shape).index_select(0, slots),
                cache[1].reshape(shape).index_select(0, slots))

    def _run_window(self, win: _Window) -> None:
        rows = self.residual_grad[win.start:win.end]
        grads = self.window_gradients(win.layer, rows)
        self.walk(win, grads, reversed(self.graph.ops), rows)
        self.finish_window(grads, rows)

    def window_gradients(self, layer: int, rows: torch.Tensor) -> WindowGradients:
        """A window's gradients, starting from dL/d(the layer's output) = `rows`."""
        grads = WindowGradients(self._needed[layer > 0], use_triton(rows.device))
        grads.values[self.graph.ops[-1].outputs[0]] = rows
        return grads

    def walk(self, win: _Window, grads: WindowGradients, ops: Iterable[Op],
             rows: torch.Tensor) -> None:
        """The backward of `ops` (a stretch of the layer's ops in reverse order)."""
        for op in ops:
            grad = grads.values.get(op.outputs[0])
            if grad is not None:
                self._op_backward(win, op, grad, grads, rows)
            # Free what nothing reads any more before the next op allocates (a 4096-token
            # window of Llama-3.1-8B: dL/dm in fp32, dL/dgate and dL/dup, m: 0.6 GB).
            for name in op.outputs:
                grads.drop(name)
            win.release(self._dead_after[op.name], attention=op.kind == "attention")

    def finish_window(self, grads: WindowGradients, rows: torch.Tensor) -> None:
        """dL/dx of the window's rows into `rows` (for the layer below)."""
        if grads.needed["x"] and grads.values["x"] is not rows:
            rows.copy_(grads.values["x"])

    def attention_gradients(self, layer: int, start: int, end: int, grad: torch.Tensor
                            ) -> dict[str, torch.Tensor]:
        """The attention op's backward of window [start, end) given dL/d(its output), eagerly:
        its inputs' gradients by name (those needed), as `walk` would hand them on."""
        op = self.attention_op
        grads = WindowGradients(self._needed[layer > 0], use_triton(grad.device))
        self._attention_backward(_Window(self, layer, start, end), op, grad, grads)
        return {name: grads.values[name] for name in op.inputs if name in grads.values}

    def lora_kernel_paths(self, rows: int) -> tuple[bool, int]:
        """Which LoRA ops of a window of `rows` rows run on fused LoRA kernels: (LoRA A's op as
        kernels 4's term and 5, `fused_lora_a_backward`; the largest output size whose LoRA B op
        runs as kernel 3, `lora_train_ds_db_bwd`, 0 for none). Where `use_triton` and the kernels
        take the adapter (`lora_kernels_fit`): LoRA A's op of an adapter with dropout in every
        window (the mask is regenerated in registers), otherwise both in the window and output
        sizes of the configs' `engine_lora_backward`, where they were measured faster than the
        torch GEMMs (docs/benchmarks.md). Staged adapters of several jobs run LoRA A's op on the
        kernels in every window (S and dS stay rank r, each row routed to its job's block, where
        the torch products would be `width` times wider); kernel 3 by the same limits."""
        if not self._lora_kernels_fit or not use_triton(self.residual_grad.device):
            return False, 0
        if self._kernel_limits is None:
            self._kernel_limits = train_configs(self.residual_grad.device)["engine_lora_backward"]
        limits = self._kernel_limits
        lora_a = self.store.lora_dropout > 0 or self.staged is not None or rows <= limits["lora_a_max_rows"]
        return lora_a, limits["ds_db_max_out"] if rows <= limits["ds_db_max_rows"] else 0

    def lora_parts(self, layer: int, target: str
                   ) -> tuple[LoRALinear, int, torch.Tensor, torch.Tensor]:
        """(the LoRA linear, the adapter's rank, dL/dA buffer, dL/dB buffer) of a target of a
        layer."""
        return self._lora[(layer, target)]

    def lora_weights(self, layer: int, target: str) -> tuple[torch.Tensor, ...]:
        """(A [R, in], B [out, R], scaling (a scalar, or [R] per column), dA, dB) the LoRA math
        of a target reads: the slot's rank-r adapter, or every staged job's side by side."""
        st = self.staged
        if st is not None:  # dB goes through `StagedLoRA.add_grad_b`
            return st.a[target], st.b[target], st.scale[target], st.grad_a[target], None
        module, rank, grad_a, grad_b = self._lora[(layer, target)]
        return (module.lora_a[self.lora_slot, :rank], module.lora_b[self.lora_slot, :, :rank],
                module.scaling[self.lora_slot], grad_a, grad_b)

    def needs_gradient(self, layer: int, name: str) -> bool:
        """Whether a window of `layer` needs dL/d`name` (else its producer's backward is skipped)."""
        return self._needed[layer > 0].get(name, False)

    def dead_after(self, op: Op) -> tuple[str, ...]:
        """The forward tensors a window may drop once `op`'s backward has run."""
        return self._dead_after[op.name]

    @property
    def attention_op(self) -> Op:
        return next(op for op in self.graph.ops if op.kind == "attention")

    def _op_backward(self, win: _Window, op: Op, grad: torch.Tensor, grads: WindowGradients,
                     rows: torch.Tensor) -> None:
        kind, name, needed, give, fused = (op.kind, op.inputs[0], grads.needed, grads.give,
                                           grads.fused)
        if kind == "add":
            for name in op.inputs:
                give(name, grad)
        elif kind == "rmsnorm" and needed[name]:
            if self.tp.world_size > 1:
                # The norm's output feeds column-parallel projections: each rank's dX is the
                # share of its heads or features, and the norm's backward needs their sum.
                grad = self.tp.all_reduce(grad.to(torch.float32, copy=True))
            if fused:
                self._rmsnorm_fused(win, op, grad, grads, rows)
            else:
                norm = getattr(win.decoder, op.name)
                give(name, rmsnorm_backward(win.act(name), norm.weight, norm.variance_epsilon,
                                            grad))
        elif kind == "linear" and needed[name]:
            weight = self.linear(win.layer, op.name.split(".")[0]).weight  # frozen: dX only
            old = grads.values.get(name)
            adds = self._adds_fused_bypass_dx if win.lora_kernels else self._adds_bypass_dx
            if op.name in adds and old is not None and (win.wide_lora_gemms or win.lora_kernels):
                # The bypass's fp32 dX (and what came before it) is there: the GEMM adds it
                # in its epilogue, one rounding, on both paths (a new tensor either way).
                grads.values[name] = addmm_fp32(old, grad.to(weight.dtype), weight)
                grads.set_owned(name, fused)
                return
            dx = grad.to(weight.dtype) @ weight
            # Fused: the model-dtype product is the gradient's exact value; whoever reads it
            # widens it (a kernel in registers, a sum by promotion), never a separate cast.
            if fused:
                give(name, dx, fresh=True)
            else:
                give(name, dx.float())
        elif kind == "lora_a" and win.lora_kernels:
            self._lora_a_fused(win, op, grad, grads)
        elif (kind == "lora_b" and win.ds_db_max_out
              and self.linear(win.layer, op.name.split(".")[0]).out_features <= win.ds_db_max_out):
            self._lora_b_fused(win, op, grad, grads)
        elif kind == "lora_b":
            _, lora_b, scaling, _, grad_b = self.lora_weights(win.layer, op.name.split(".")[0])
            grad, s = grad.float(), win.act(name)
            if self.staged is not None and win.lora_kernels:
                s = self.staged.expand(s)  # S is rank r on the kernels' routing: into its block
            product = (grad.T @ s.float()) * scaling
            if self.staged is None:
                grad_b.add_(product)
            else:
                self.staged.add_grad_b(op.name.split(".")[0], product)
            if needed[name]:
                ds = (grad @ lora_b.float()) * scaling
                if self.staged is not None:
                    ds = self.staged.own_block(ds) if win.lora_kernels else self.staged.keep(ds)
                give(name, ds, fresh=True)
        elif kind == "lora_a":
            lora_a, _, _, grad_a, _ = self.lora_weights(win.layer, op.name.split(".")[0])
            act, rank = win.act(name), lora_a.shape[0]
            if win.wide_lora_gemms and act.dtype == lora_a.dtype == torch.bfloat16:  # both paths
                split = split_bf16(grad.float())  # [n, 2 * rank]
                pair = mm_fp32(split.T, act)
                grad_a.add_(pair[:rank]).add_(pair[rank:])
                if needed[name]:
                    give(name, mm_fp32(split, torch.cat([lora_a, lora_a])), fresh=True)
                return
            grad = grad.float()
            grad_a.add_(grad.T @ act.float())
            if needed[name]:
                give(name, grad @ lora_a.float(), fresh=True)
        elif kind == "dropout" and needed[name]:
            keep = win.dropout_mask(op.name.split(".")[0])
            give(name, apply_lora_dropout(grad.float(), keep, self.store.lora_dropout), fresh=True)
        elif kind == "rope" and needed[name]:
            if fused:
                dtype = self._grad_dtype(win.layer, name)
                give(name, fused_rope_backward(grad, win.cos, win.sin, self.head_dim, dtype),
                     fresh=True)
            else:
                give(name, rope_backward(grad, win.cos, win.sin, self.head_dim))
        elif kind == "attention":
            self._attention_backward(win, op, grad, grads)
        elif kind == "silu_mul":
            gate_name, up_name = op.inputs
            gate, up = win.act(gate_name), win.act(up_name)
            if fused:
                dtypes = tuple(self._grad_dtype(win.layer, n) for n in op.inputs)
                d_gate, d_up = fused_silu_mul_backward(grad, gate, up, dtypes)
            else:
                d_gate, d_up = silu_mul_backward(grad, gate, up)
            give(gate_name, d_gate, fresh=fused)  # only the fused path sums in place
            give(up_name, d_up, fresh=fused)
        elif kind not in ("rmsnorm", "linear", "dropout", "rope"):
            raise ValueError(f"no backward for op kind {kind!r} ({op.name})")

    def _lora_a_fused(self, win: _Window, op: Op, grad: torch.Tensor,
                      grads: WindowGradients) -> None:
        """LoRA A's backward as the fused LoRA kernels (`fused_lora_a_backward`), giving dX to
        the frozen linear's input, where its dX GEMM adds it. With dropout it reads the dropout's
        input and regenerates the mask in registers (or reads the dropout's output where the plan
        stores it)."""
        target, name = op.name.split(".")[0], op.inputs[0]
        if self.staged is not None:  # several jobs' rows, each on its own block
            st = self.staged
            term = fused_lora_a_backward(grad, win.act(name), st.blocks_a(target), 0.0, 0,
                                         st.grad_a[target].view(st.width, st.rank, -1), x_dropped=False,
                                         want_dx=grads.needed[name], meta=win.kernel_meta)
            if term is not None:
                grads.give(name, term, fresh=True)
            return
        module, rank, grad_a, _ = self._lora[(win.layer, target)]
        src = self._dropout_input.get(target, name)
        x_dropped = src != name and name in self.store.stored_names[win.layer]
        seed = dropout_window_seed(self.store.dropout_seed, win.layer, target, win.start)
        term = fused_lora_a_backward(grad, win.act(name if x_dropped else src),
                                     module.lora_a[self.lora_slot, :rank], self.store.lora_dropout,
                                     seed, grad_a, x_dropped=x_dropped, want_dx=grads.needed[src])
        if term is not None:
            grads.give(src, term, fresh=True)

    def _lora_b_fused(self, win: _Window, op: Op, grad: torch.Tensor,
                      grads: WindowGradients) -> None:
        """LoRA B's backward as fused LoRA kernel 3 (`fused_lora_b_backward`): dB added into the
        adapter's fp32 gradient and dS given to S, from one pass over dY, in fp32 as the torch
        ops."""
        target, name = op.name.split(".")[0], op.inputs[0]
        if self.staged is not None:  # several jobs' rows, each on its own block
            st = self.staged
            ds = fused_lora_b_backward(grad.float(), win.act(name), st.blocks_b(target), st.block_scale[target],
                                       st.grad_b_blocks[target], meta=win.kernel_meta)
        else:
            module, rank, _, grad_b = self._lora[(win.layer, target)]
            slot = self.lora_slot
            ds = fused_lora_b_backward(grad.float(), win.act(name), module.lora_b[slot, :, :rank],
                                       module.scaling[slot:slot + 1], grad_b)
        if grads.needed[name]:
            grads.give(name, ds, fresh=True)

    def _rmsnorm_fused(self, win: _Window, op: Op, grad: torch.Tensor, grads: WindowGradients,
                       rows: torch.Tensor) -> None:
        """One kernel: dL/dx of the norm plus the gradient x already has (the residual add's),
        summed into a buffer this window owns, or into the residual rows themselves when this is
        the layer's last backward op (nothing reads the rows' old values after it)."""
        from flexserve_kernels.finetune_backward import rmsnorm_backward as rmsnorm_backward_fused

        name, norm = op.inputs[0], getattr(win.decoder, op.name)
        previous = grads.values.get(name)
        if name == "x" and op is self.graph.ops[0]:
            out = rows
        elif previous is not None and grads.owns(name):
            out = previous
        else:
            out = None
        grads.values[name] = rmsnorm_backward_fused(
            win.act(name), norm.weight, norm.variance_epsilon, grad, previous, out=out)
        grads.set_owned(name, out is not rows)

    def _grad_dtype(self, layer: int, name: str) -> torch.dtype:
        """The dtype a fused kernel writes dL/d`name` in: the weight's when its one reader is a
        frozen projection's dX GEMM, which casts it to that dtype anyway (one rounding either
        way); fp32 otherwise."""
        target = self._gemm_only.get(name)
        return torch.float32 if target is None else self.linear(layer, target).weight.dtype

    def _attention_backward(self, win: _Window, op: Op, grad: torch.Tensor,
                            grads: WindowGradients) -> None:
        out, q, k, v = win.attention_graph()
        n = win.end - win.start
        grad_out = grad.view(n, self.num_heads, self.head_dim).transpose(0, 1).unsqueeze(0)
        with torch.inference_mode(False), torch.enable_grad():
            torch.autograd.backward(out, grad_out.to(out.dtype))
        q_name, k_name, v_name = op.inputs
        # Fused: the rope kernel widens dQ as it reads it.
        grads.give(q_name, q.grad.reshape(n, -1) if grads.fused else q.grad.float().view(n, -1))
        # This window's queries reach keys [0, end): their dK, dV join the accumulator, which
        # then holds the complete gradient of the window's own keys and values.
        for name, leaf, acc in ((k_name, k, self.key_grad), (v_name, v, self.value_grad)):
            if grads.needed[name]:
                acc[:win.end].add_(leaf.grad)
                grads.give(name, acc[win.start:win.end].view(n, -1))


class WindowUnsupported(RuntimeError):
    """A gathered window (`_Window` with `rows`) needs what only an eager window has."""


class _Window:
    """One backward window's forward tensors, read from the store or rematerialized once.

    Gathered (`rows`, `positions` and `arena` given, for a captured graph): the window has
    `end - start` rows whose stored tensors are rows `rows` of `arena`'s tensors and whose
    rotary angles are those of `positions`, so one capture serves any window of its size. It
    reads nothing from the KV cache: attention and what needs it raise `WindowUnsupported`.
    """

    def __init__(self, owner: SequenceBackward, layer: int, start: int, end: int,
                 rows: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                 arena: ActivationArena | None = None) -> None:
        self.owner, self.layer, self.start, self.end = owner, layer, start, end
        self.rows, self.arena = rows, arena
        # The torch path's LoRA products: 16-bit GEMMs with fp32 outputs in windows this wide,
        # widened operands below (WIDE_LORA_GEMM_ROWS); the fused kernels where they run.
        self.wide_lora_gemms = end - start >= WIDE_LORA_GEMM_ROWS
        self.lora_kernels, self.ds_db_max_out = owner.lora_kernel_paths(end - start)
        # staged adapters on the kernels: their routing of this window's rows
        self.kernel_meta = (owner.staged.kernel_meta(end - start)
                            if owner.staged is not None and self.lora_kernels else None)
        self.decoder = owner.model.model.layers[layer]
        self.dtype = owner.store.dtype
        cache = owner.model.model.rotary_emb.cos_sin_cache
        cos_sin = (cache[start:end] if positions is None
                   else cache.index_select(0, positions)).unsqueeze(1)
        self.cos, self.sin = cos_sin.chunk(2, dim=-1)  # fp32 [n, 1, head_dim / 2]
        self._acts: dict[str, torch.Tensor] = {}
        self._attention: tuple[torch.Tensor, ...] | None = None

    def act(self, name: str) -> torch.Tensor:
        """Forward tensor `name` of the window's rows, [n, width]."""
        if name not in self._acts:
            self._acts[name] = self._load(name)
        return self._acts[name]

    def dropout_mask(self, target: str) -> torch.Tensor:
        if self.rows is not None:
            raise WindowUnsupported("a gathered window has no dropout masks")
        return self.owner.store.dropout_mask(self.layer, target, self.start, self.end)

    def release(self, names: tuple[str, ...], attention: bool = False) -> None:
        """Drop the loaded or rematerialized tensors `names` (and the attention graph)."""
        for name in names:
            self._acts.pop(name, None)
        if attention:
            self._attention = None

    def attention_graph(self) -> tuple[torch.Tensor, ...]:
        """(out [1, H, n, D], q, k, v leaves) of the window's attention, recorded by autograd
        once and shared by a rematerialization of `attn` and the attention backward."""
        if self._attention is None:
            if self.rows is not None:
                raise WindowUnsupported("a gathered window has no attention")
            owner = self.owner
            n = self.end - self.start
            q = self.act("q").view(n, owner.num_heads, owner.head_dim)
            with torch.inference_mode(False), torch.enable_grad():
                # Gathered here, the K/V rows are ordinary tensors: leaves without a copy.
                k, v = (_leaf(t.to(q.dtype)) for t in owner.cached_kv(self.layer, self.end))
                q = _leaf(q)
                # [1, heads, rows, D] views of the [rows, heads, D] tensors: the layout the
                # fused kernels read (no copy); K/V keep their KV heads (`window_attention`).
                out = window_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                       owner.scale)
            self._attention = (out, q, k, v)
        return self._attention

    def _load(self, name: str) -> torch.Tensor:
        value = self._compute(name)
        if (name in ROW_PARALLEL_OUTPUTS and self.owner.tp.world_size > 1
                and name not in self.owner.store.stored_names[self.layer]):
            # Rematerialized from this rank's input columns: a partial sum, as in the forward
            # before its all-reduce (a stored one was kept after it).
            value = self.owner.tp.all_reduce(value.clone())
        return value

    def _compute(self, name: str) -> torch.Tensor:
        owner, store, layer = self.owner, self.owner.store, self.layer
        if name in store.stored_names[layer]:
            if self.rows is None:
                return store.read(layer, name, self.start, self.end)
            value = self.arena.get(layer, name).index_select(0, self.rows)
            if owner.staged is not None and name in owner._shrinks and not self.lora_kernels:
                return owner.staged.expand(value)  # each row's shrink in its job's block
            return value
        if name in store.kv_cache_names and self.rows is not None:
            raise WindowUnsupported(f"a gathered window cannot read {name} from the KV cache")
        if name in store.kv_cache_names:  # "k" or "v_out"
            k_all, v_all = owner.cached_kv(layer, self.end)
            return (k_all if name == "k" else v_all)[self.start:].flatten(1)
        op = owner.graph.producer(name)
        if op is None:
            raise KeyError(f"{name} is neither stored nor computable")
        target = op.name.split(".")[0]
        source = owner.graph.producer(op.inputs[0])
        if (op.kind == "lora_a" and source is not None and source.kind == "dropout" and self.lora_kernels
                and op.inputs[0] not in store.stored_names[layer]):
            # S of a dropout output the plan does not keep, as the forward computed it: fused LoRA
            # kernel 1 over the dropout's input with the mask hashed in registers, neither the mask
            # nor the dropout output built as a tensor.
            _, rank, _, _ = owner._lora[(layer, target)]
            lora_a = owner.linear(layer, target).lora_a[owner.lora_slot, :rank]
            seed = dropout_window_seed(store.dropout_seed, layer, target, self.start)
            return fused_lora_dropout_shrink(self.act(source.inputs[0]), lora_a, store.lora_dropout, seed)
        x = self.act(op.inputs[0])
        if op.kind == "rmsnorm":
            norm = getattr(self.decoder, op.name)
            return rmsnorm_forward(x, norm.weight, norm.variance_epsilon)
        if op.kind == "linear":
            module = owner.linear(layer, target)
            return F.linear(x, module.weight, module.bias)
        if op.kind == "dropout":
            keep = self.dropout_mask(target)  # outputs: ({target}_xd, {target}_mask)
            if name == op.outputs[1]:
                return keep
            return apply_lora_dropout(x, keep, store.lora_dropout)
        if op.kind == "lora_a" and owner.staged is not None and self.lora_kernels:
            return lora_shrink_fused(x, owner.staged.blocks_a(target), self.kernel_meta)
        if op.kind == "lora_a":
            lora_a = owner.lora_weights(layer, target)[0]
            s = mm_fp32(x, lora_a.T) if self.wide_lora_gemms else x.float() @ lora_a.float().T
            return s if owner.staged is None else owner.staged.keep(s)
        if op.kind == "lora_b":
            _, lora_b, scaling, _, _ = owner.lora_weights(layer, target)
            if owner.staged is not None and self.lora_kernels:
                x = owner.staged.expand(x)  # S is rank r on the kernels' routing: into its block
            if owner.staged is not None:  # a scale per column
                return ((x.float() * scaling) @ lora_b.float().T).to(self.dtype)
            return ((x.float() @ lora_b.float().T) * scaling).to(self.dtype)
        if op.kind == "add":
            return x + self.act(op.inputs[1])
        if op.kind == "rope":
            return rotate(x, self.cos.to(x.dtype), self.sin.to(x.dtype), owner.head_dim)
        if op.kind == "attention":
            out = self.attention_graph()[0].detach()
            return out[0].transpose(0, 1).reshape(self.end - self.start, -1)
        if op.kind == "silu_mul":
            return F.silu(x) * self.act(op.inputs[1])
        raise ValueError(f"cannot rematerialize {name}: no forward for op kind {op.kind!r}")


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """`t` as an autograd leaf; an inference tensor (made under inference mode) is copied, as
    autograd cannot save it."""
    return (t.clone() if t.is_inference() else t.detach()).requires_grad_()

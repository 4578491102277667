"""What fine-tuning forward windows keep for the layer-wise backward (FlexLLM 5.2 and 6.1).

A fine-tuning forward window is one more row of a step's flat batch, like a prefill chunk. While
the model runs, a `FinetuneCapture` set as the forward context's `finetune` receives the named
tensors of `flexserve.peft.layer_graph` from every decoder layer and LoRA linear, and copies the
window rows of exactly the tensors the pruning plan stores into the sequence's `ActivationStore`:
token-indexed per layer, so windows write slices and backward windows read slices. K and V stay
in the paged KV cache; the backward rematerializes everything else from these.

LoRA dropout masks are a counter-based hash of (seed, layer, target, position, column), not a
random stream: the forward of one window split and the backward of any other split see the same
mask, so the pruning plans keep neither masks nor dropout outputs (`graph_pruning.
fold_lora_dropout`); a plan given by hand may still keep a mask as a bitmask (1 bit per element,
FlexLLM's compression). The hash is the fused LoRA kernels' (`flexserve_kernels.lora.train.fused`) under a
seed per (job seed, layer, target) (`dropout_salt`), rows being positions in the sequence: on
CUDA the forward's shrink (`lora_ops.lora_window_shrink`: fused LoRA kernel 1, every window of
the step and the inference rows in one launch) and the fused LoRA backward regenerate it in
registers from the window's seed (`dropout_window_seed`), never writing or reading it; where a
plan keeps the mask or the dropout output, a kernel writes the mask in one pass and the forward
applies it as a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from flexserve.peft.bypass import TARGET_MODULES
from flexserve.peft.layer_graph import LayerGraph
from flexserve.worker.finetune.activation_arena import ActivationArena
from flexserve.worker.finetune.activation_offload import HostOffload
from flexserve_kernels.dispatch import use_triton
from flexserve_kernels.lora.serve.meta import DropoutWindows
from flexserve_kernels.lora.serve.ops import (
    MAX_WINDOW_RANK,
    lora_shrink,
    lora_shrink_fused,
    lora_window_shrink,
)
from flexserve_kernels.lora.train.ref import dropout_keep_ref, row_seed

COMPRESSIONS = ("bitmask",)
_TARGET_INDEX = {target: i for i, target in enumerate(TARGET_MODULES)}
_M32 = 0xFFFFFFFF


# ------------------------------------------------------------------------------------- dropout
def _hash32(x: int) -> int:
    """A 32-bit integer mix (lowbias32) of an int in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def dropout_salt(seed: int, layer: int, target: str) -> int:
    """The 32-bit hash seed of `target`'s dropout mask in `layer` for a sequence's seed."""
    return _hash32((_hash32(seed & _M32) ^ (layer * len(TARGET_MODULES) + _TARGET_INDEX[target]))
                   & _M32)


def dropout_window_seed(seed: int, layer: int, target: str, start: int) -> int:
    """The kernels' seed under which rows 0, 1, ... of a window hash as positions start, ..."""
    return row_seed(dropout_salt(seed, layer, target), start)


def dropout_keep_mask(
    seed: int, layer: int, target: str, start: int, num_tokens: int, width: int, p: float,
    device: torch.device | str,
) -> torch.Tensor:
    """bool [num_tokens, width]: which inputs LoRA dropout keeps at positions [start, start + n)
    of `target` in `layer`; each is kept with probability 1 - p, the same for any window split
    (the fused kernels' hash: a Triton kernel where `use_triton`, the torch reference elsewhere)."""
    window_seed = dropout_window_seed(seed, layer, target, start)
    if use_triton(device):
        from flexserve_kernels.lora.train.dropout import dropout_keep_mask as keep_mask_kernel

        return keep_mask_kernel(window_seed, num_tokens, width, p, device)
    return dropout_keep_ref(window_seed, num_tokens, width, p, device)


def apply_lora_dropout(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """x with dropped entries zeroed and kept ones scaled by 1 / (1 - p) (torch's Dropout)."""
    return x * (keep.to(x.dtype) / (1.0 - p))


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [n, width] -> uint8 [n, ceil(width / 8)], bit j of byte b is column 8 * b + j."""
    n, width = mask.shape
    padded = F.pad(mask.to(torch.uint8), (0, -width % 8)).view(n, -1, 8)
    shifts = torch.arange(8, device=mask.device, dtype=torch.uint8)
    return (padded << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """The inverse of `pack_bits`: uint8 [n, ceil(width / 8)] -> bool [n, width]."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = (packed[..., None] >> shifts) & 1
    return bits.view(packed.shape[0], -1)[:, :width].bool()


# ------------------------------------------------------------------------------- the store
def _element_dtype(spec_dtype: str, act_dtype: torch.dtype) -> torch.dtype:
    return {"act": act_dtype, "fp32": torch.float32}[spec_dtype]


class ActivationStore:
    """The activations one fine-tuning sequence keeps for its backward.

    `plan` is a `flexserve.peft.graph_pruning.PruningPlan` (or anything with its `stored`,
    `kv_cache`, `rematerialized` and `compressed`) for every layer, or a list of one per layer
    (e.g. layer 0's from `plan_pruning(..., input_grad=False)`). In each layer every tensor of
    `stored` is a buffer [max_len, width] of its graph dtype ("act": `dtype`, the model's), except
    KV-cache tensors (k, v_out: not kept here) and bool tensors (dropout masks), which are packed
    bitmasks [max_len, ceil(width / 8)] uint8. All buffers are allocated here, once.
    `lora_dropout` and `dropout_seed` are the job's; the graph has dropout ops exactly when
    lora_dropout > 0. The layers in `offload_layers` (all with the same plan) keep their buffers
    in host memory instead (`HostOffload`); the backward calls `prepare_layer` before a layer's
    first window; `offload_host_rows` sizes their host buffers (`HostOffload`). With an `arena`
    (`ActivationArena`) and no offload, the buffers are views of a row range allocated from it
    (`arena_base`; None when it had no room), which CUDA graphs can write; `release` returns it.
    """

    def __init__(
        self, graph: LayerGraph, plan: Any, num_layers: int, max_len: int, dtype: torch.dtype,
        device: torch.device | str, *, lora_dropout: float = 0.0, dropout_seed: int = 0,
        offload_layers: tuple[int, ...] = (), offload_host_rows: int | None = None,
        arena: ActivationArena | None = None,
    ) -> None:
        if num_layers < 1 or max_len < 1:
            raise ValueError(f"num_layers ({num_layers}) and max_len ({max_len}) must be >= 1")
        plans = list(plan) if isinstance(plan, (list, tuple)) else [plan] * num_layers
        if len(plans) != num_layers:
            raise ValueError(f"{len(plans)} plans for {num_layers} layers")
        has_dropout = any(op.kind == "dropout" for op in graph.ops)
        if not 0.0 <= lora_dropout < 1.0 or has_dropout != (lora_dropout > 0):
            raise ValueError(f"lora_dropout {lora_dropout} does not match the layer graph, which "
                             f"{'has' if has_dropout else 'has no'} dropout ops")
        graph_kv = frozenset(n for n, spec in graph.tensors.items() if spec.storage == "kv_cache")
        self.graph = graph
        self.num_layers = num_layers
        self.max_len = max_len
        self.dtype = dtype
        self.device = torch.device(device)
        self.lora_dropout = lora_dropout
        self.dropout_seed = dropout_seed
        self.kv_cache_names = graph_kv  # read from the paged KV cache, never kept here
        self.dropout_targets = frozenset(
            op.name.split(".")[0] for op in graph.ops if op.kind == "dropout")
        self._dropout_salts: np.ndarray | None = None
        self.stored_names: list[frozenset[str]] = []  # per layer: kept in full
        self.bitmask_names: list[frozenset[str]] = []  # per layer: kept as packed bits
        self._row_bytes: dict[tuple[int, str], int] = {}
        self._widths: dict[tuple[int, str], int] = {}
        self._elements: dict[tuple[int, str], torch.dtype] = {}
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        offload = frozenset(offload_layers)
        if not offload <= set(range(num_layers)):
            raise ValueError(f"offload layers {sorted(offload)} are not all in 0..{num_layers - 1}")
        # A plan shared by many layers (the usual case) is checked and laid out once.
        layouts: dict[int, tuple[frozenset[str], frozenset[str], list[tuple]]] = {}
        offload_layout = None
        for layer, layer_plan in enumerate(plans):
            layout = layouts.get(id(layer_plan))
            if layout is None:
                full, bits = _check_plan_names(graph, layer_plan, graph_kv)
                layout = layouts[id(layer_plan)] = (full, bits, _buffer_layout(graph, full, bits,
                                                                               dtype))
            full, bits, buffers = layout
            self.stored_names.append(full)
            self.bitmask_names.append(bits)
            if layer in offload:
                if offload_layout not in (None, buffers):
                    raise ValueError("offloaded layers must keep the same tensors (one plan)")
                offload_layout = buffers
            for name, width, elem in buffers:
                key = (layer, name)
                if layer not in offload:
                    self._buffers[key] = None  # allocated below, from the arena or alone
                self._row_bytes[key] = width * elem.itemsize
                self._widths[key] = width
                self._elements[key] = elem
        self._num_written: dict[tuple[int, str], int] = dict.fromkeys(self._row_bytes, 0)
        self.arena, self.arena_base = None, None
        if arena is not None and not offload and all(
                arena.holds(*key, width, self._elements[key])
                for key, width in self._widths.items()):
            self.arena_base = arena.allocate(max_len)
            if self.arena_base is not None:
                self.arena = arena
        for layer, name in self._buffers:
            width, elem = self._widths[(layer, name)], self._elements[(layer, name)]
            self._buffers[(layer, name)] = (
                arena_rows(self.arena, layer, name, width, elem, self.arena_base, max_len)
                if self.arena is not None
                else torch.empty((max_len, width), dtype=elem, device=self.device))
        self._offload = (HostOffload(offload_layout, tuple(offload), max_len, self.device,
                                     host_rows=offload_host_rows)
                         if offload and offload_layout else None)
        # kept up to date by free_layer: the runner sums it over every store after each step
        self._num_bytes = sum(buf.nbytes for buf in self._buffers.values()) + (
            len(self._offload.slots) * self._offload.slot_bytes if self._offload else 0)
        self.num_forward_tokens = 0  # positions [0, this) have been through the forward

    def layer_bytes_per_token(self, layer: int) -> int:
        """Bytes one token keeps in `layer` (what its plan's bytes_per_token predicts)."""
        return sum(n for (i, _), n in self._row_bytes.items() if i == layer)

    @property
    def num_bytes(self) -> int:
        """Device bytes of the buffers still allocated (offloaded layers: the ring's slots)."""
        return self._num_bytes

    @property
    def host_bytes(self) -> int:
        """Host bytes of the offloaded layers not yet freed."""
        return self._offload.host_bytes_left if self._offload else 0

    @property
    def offload_layers(self) -> tuple[int, ...]:
        return self._offload.layers if self._offload else ()

    @property
    def num_bytes_stored(self) -> int:
        """Bytes the forward windows have written into the buffers still allocated."""
        return sum(n * self._row_bytes[key] for key, n in self._num_written.items())

    def dropout_salts(self) -> np.ndarray:
        """[num_layers, len(TARGET_MODULES)] int64: `dropout_salt` of every (layer, target) under
        the sequence's seed, computed on first use (once per sequence)."""
        if self._dropout_salts is None:
            self._dropout_salts = np.array(
                [[dropout_salt(self.dropout_seed, layer, target) for target in TARGET_MODULES]
                 for layer in range(self.num_layers)], dtype=np.int64)
        return self._dropout_salts

    def keeps(self, layer: int, name: str) -> bool:
        """Whether `layer` keeps `name` in full (not as a bitmask, not in the KV cache)."""
        return name in self.stored_names[layer]

    def begin_window(self, start: int, num_tokens: int) -> None:
        """Admit the forward window [start, start + num_tokens): windows come in order."""
        if start != self.num_forward_tokens or num_tokens < 1:
            raise ValueError(f"forward window [{start}, {start + num_tokens}) is out of order: the "
                             f"next window starts at {self.num_forward_tokens}")
        if start + num_tokens > self.max_len:
            raise ValueError(f"forward window [{start}, {start + num_tokens}) runs past the "
                             f"store's max_len {self.max_len}")
        self.num_forward_tokens = start + num_tokens

    def buffer_spec(self, layer: int, name: str) -> tuple[int, torch.dtype]:
        """(row width, element dtype) of a kept tensor's buffer."""
        return self._widths[(layer, name)], self._elements[(layer, name)]

    def mark_written(self, start: int, num_tokens: int) -> None:
        """Record that a graph wrote positions [start, start + num_tokens) of every kept tensor
        (`GraphCapture`), as `write` records its own copies."""
        end = start + num_tokens
        for key in self._buffers:
            if end > self._num_written[key]:
                self._num_written[key] = end

    def release(self) -> None:
        """Return the arena rows (the sequence is done); the store is unusable afterwards."""
        if self.arena is not None:
            self.arena.release(self.arena_base)
            self.arena = None
            self._buffers.clear()

    def write(self, layer: int, name: str, start: int, rows: torch.Tensor) -> None:
        """Copy rows [n, >= width] (cast to the buffer's dtype) to positions [start, start + n)."""
        key = (layer, name)
        n = rows.shape[0]
        width = self._widths[key]
        rows = rows if rows.shape[1] == width else rows[:, :width]
        if self._offload is not None and layer in self._offload:
            self._offload.write(layer, name, start, rows)
        else:
            self._buffers[key][start:start + n].copy_(rows)
        if start + n > self._num_written[key]:
            self._num_written[key] = start + n

    def write_mask(self, layer: int, name: str, start: int, keep: torch.Tensor) -> None:
        """Pack a bool [n, width] mask into the bitmask of `name` at [start, start + n)."""
        self.write(layer, name, start, pack_bits(keep))

    def prepare_layer(self, layer: int) -> None:
        """Before `layer`'s first backward window: its offloaded rows (if any) come back to the
        device, and the next offloaded layers below start coming."""
        if self._offload is not None:
            self._offload.prepare(layer, self.num_forward_tokens)

    def read(self, layer: int, name: str, start: int, end: int) -> torch.Tensor:
        """Positions [start, end) of a tensor kept in full: a view [end - start, width]."""
        return self._buffer_rows(layer, name, end)[start:end]

    def dropout_mask(self, layer: int, target: str, start: int, end: int) -> torch.Tensor:
        """bool [end - start, in]: the LoRA dropout mask of `target` (`{target}_mask`), from the
        bitmask when kept and regenerated otherwise: both are the mask the forward used."""
        name = f"{target}_mask"
        width = self.graph.tensors[name].width
        if name in self.bitmask_names[layer]:
            return unpack_bits(self._buffer_rows(layer, name, end)[start:end], width)
        return dropout_keep_mask(self.dropout_seed, layer, target, start, end - start, width,
                                 self.lora_dropout, self.device)

    def free_layer(self, layer: int) -> None:
        """Release one layer's buffers (its backward is done)."""
        for key in [key for key in self._buffers if key[0] == layer]:
            self._num_bytes -= self._buffers.pop(key).nbytes
        for key in [key for key in self._num_written if key[0] == layer]:
            del self._num_written[key]
        offload = self._offload
        if offload is not None and layer in offload:
            offload.release(layer)
            if offload.done:  # every offloaded layer's backward is over: the ring goes too
                self._num_bytes -= len(offload.slots) * offload.slot_bytes
                self._offload = None

    def _buffer_rows(self, layer: int, name: str, end: int) -> torch.Tensor:
        key = (layer, name)
        if key not in self._num_written:
            raise KeyError(f"layer {layer} keeps no {name!r} (freed, or not in the plan)")
        if end > self._num_written[key]:
            raise RuntimeError(
                f"layer {layer} {name!r}: positions up to {end} were asked for but only "
                f"{self._num_written[key]} were captured (forward windows without the capture, "
                "or fine-tuning rows without their LoRA slot?)")
        if self._offload is not None and layer in self._offload:
            return self._offload.read(layer, name)
        return self._buffers[key]


def arena_rows(arena: ActivationArena, layer: int, name: str, width: int, dtype: torch.dtype,
               base: int, num_rows: int) -> torch.Tensor:
    """Rows [base, base + num_rows) of the arena tensor of (layer, name)."""
    return arena.tensor(layer, name, width, dtype)[base:base + num_rows]


def store_layout(graph: LayerGraph, plans: list[Any], dtype: torch.dtype
                 ) -> list[tuple[int, str, int, torch.dtype]]:
    """(layer, name, row width, element dtype) of every buffer a store of these per-layer plans
    allocates: what an `ActivationArena` reserves for them."""
    graph_kv = frozenset(n for n, spec in graph.tensors.items() if spec.storage == "kv_cache")
    layout = []
    for layer, plan in enumerate(plans):
        full, bits = _check_plan_names(graph, plan, graph_kv)
        layout += [(layer, name, width, elem)
                   for name, width, elem in _buffer_layout(graph, full, bits, dtype)]
    return layout


def _buffer_layout(graph: LayerGraph, full: frozenset[str], bits: frozenset[str],
                   dtype: torch.dtype) -> list[tuple[str, int, torch.dtype]]:
    """(name, row width, element dtype) of one layer's buffers; bitmasks are packed uint8 rows."""
    layout = []
    for name in sorted(full | bits):
        spec = graph.tensors[name]
        if name in bits:
            layout.append((name, -(-spec.width // 8), torch.uint8))
        else:
            layout.append((name, spec.width, _element_dtype(spec.dtype, dtype)))
    return layout


def _check_plan_names(
    graph: LayerGraph, plan: Any, graph_kv: frozenset[str]
) -> tuple[frozenset[str], frozenset[str]]:
    """(kept in full, kept as bitmasks) of one layer's plan; ValueError for names the graph
    lacks, KV tensors outside the cache, or a compression other than a bool tensor's bitmask."""
    compressed = dict(plan.compressed)
    for group, names in (("stored", plan.stored), ("kv_cache", plan.kv_cache),
                         ("rematerialized", plan.rematerialized), ("compressed", compressed)):
        unknown = sorted(set(names) - set(graph.tensors))
        if unknown:
            raise ValueError(f"plan.{group} names tensors the layer graph lacks: {unknown}")
    if not set(plan.kv_cache) <= graph_kv:
        raise ValueError(f"the paged KV cache holds only {sorted(graph_kv)}, not "
                         f"{sorted(set(plan.kv_cache) - graph_kv)}")
    for name, how in compressed.items():
        if how not in COMPRESSIONS or graph.tensors[name].dtype != "bool":
            raise ValueError(f"compression {how!r} of {name} is not supported: only bool tensors "
                             f"(dropout masks) are kept compressed, as {COMPRESSIONS}")
    stored = frozenset(plan.stored) | frozenset(compressed)
    bits = frozenset(n for n in stored if graph.tensors[n].dtype == "bool")
    return stored - graph_kv - bits, bits


# ------------------------------------------------------------------------------- the capture
@dataclass(slots=True)
class CaptureWindow:
    """One fine-tuning forward window in the step's flat batch."""

    store: ActivationStore  # the sequence's store
    flat_start: int  # the window's first token in the flat batch
    start: int  # that token's position in the sequence
    num_tokens: int  # window length
    lora_slot: int  # the job adapter's LoRA slot (the rows' slot in the step's LoRAKernelMeta)

    @property
    def rows(self) -> slice:
        return slice(self.flat_start, self.flat_start + self.num_tokens)


class FinetuneCapture:
    """The forward context's `finetune` for one step: copies fine-tuning rows into their stores.

    Register every fine-tuning window with `add_window` before the forward; afterwards
    `final_stream(i)` is window i's output of the last decoder layer (before the final norm),
    where `window_loss` starts.

    `add_window` files the window under every (layer, name) its store keeps in full, so each of
    the ~30 `take` calls a layer makes is one dict lookup, and names no window keeps cost nothing
    more (a 32-layer step with one window makes ~1000 of them).
    """

    def __init__(self) -> None:
        self.windows: list[CaptureWindow] = []
        self._final: torch.Tensor | None = None
        # (layer, name) -> the windows whose store keeps that tensor in full, in window order
        self._keepers: dict[tuple[int, str], list[CaptureWindow]] = {}
        self._dropout_targets: frozenset[str] = frozenset()  # targets some window's job drops out
        self._dropout_windows: DropoutWindows | None = None  # built on first use, per step

    def add_window(
        self, store: ActivationStore, flat_start: int, start: int, num_tokens: int, lora_slot: int
    ) -> int:
        """Register a window; returns its index. ValueError when out of order or overlapping."""
        if flat_start < 0 or (lora_slot < 0 and store.graph.bypass):
            raise ValueError(f"flat_start ({flat_start}) and, for a job with bypass networks, "
                             f"lora_slot ({lora_slot}) must be >= 0")
        for w in self.windows:
            if w.store is store:
                raise ValueError("a sequence has at most one forward window per step")
            if flat_start < w.flat_start + w.num_tokens and w.flat_start < flat_start + num_tokens:
                raise ValueError(f"flat rows [{flat_start}, {flat_start + num_tokens}) overlap "
                                 "another fine-tuning window")
        store.begin_window(start, num_tokens)
        window = CaptureWindow(store, flat_start, start, num_tokens, lora_slot)
        self.windows.append(window)
        keepers = self._keepers
        for layer, names in enumerate(store.stored_names):
            for name in names:
                keepers.setdefault((layer, name), []).append(window)
        self._dropout_targets |= store.dropout_targets
        self._dropout_windows = None
        return len(self.windows) - 1

    def wants(self, layer: int, name: str) -> bool:
        """Whether some window's store keeps `name` in full (to skip computing it otherwise)."""
        return (layer, name) in self._keepers

    def take(self, layer: int, name: str, tensor: torch.Tensor) -> None:
        """`tensor` [T, width] of the flat batch: store the window rows where the plan keeps it."""
        for w in self._keepers.get((layer, name), ()):
            w.store.write(layer, name, w.start, tensor[w.rows])

    def lora_shrink(self, module: Any, x: torch.Tensor, meta: Any, fused: bool = False) -> torch.Tensor:
        """A `LoRALinear`'s shrink s [T, max_rank] (fp32) of x (`LoRAKernelMeta` meta) with LoRA
        dropout on the rows of windows whose job drops out this target: one `lora_window_shrink`
        (on the GPU, fused LoRA kernel 1 hashes every window's mask in registers while it reads x
        once); where a window's plan keeps the dropout output or the mask, or the slot is wider
        than that shrink takes, the masked x as a tensor (`lora_input`) through `lora_shrink`.
        Without dropout, `lora_shrink`, or kernel 1 (`lora_shrink_fused`) when `fused` (the
        caller runs kernel 2 after it: `lora_linear.lora_group_forward`)."""
        target, layer = module.target, module.layer_idx
        if target not in self._dropout_targets:
            return (lora_shrink_fused if fused else lora_shrink)(x, module.lora_a, meta)
        if module.max_rank > MAX_WINDOW_RANK or self._keeps_dropout_tensors(layer, target):
            return lora_shrink(self.lora_input(module, x), module.lora_a, meta)
        if layer < 0:
            raise RuntimeError("a LoRALinear without layer_idx: use attach_lora_linears")
        group = layer * len(TARGET_MODULES) + _TARGET_INDEX[target]
        return lora_window_shrink(x, module.lora_a, meta, self.dropout_windows(x.device), group)

    def _keeps_dropout_tensors(self, layer: int, target: str) -> bool:
        """Whether a window's plan keeps `target`'s dropout output or mask in `layer`."""
        mask = f"{target}_mask"
        return (layer, f"{target}_xd") in self._keepers or any(
            mask in w.store.bitmask_names[layer] for w in self.windows if target in w.store.dropout_targets)

    def dropout_windows(self, device: torch.device) -> DropoutWindows:
        """The step's windows whose job has LoRA dropout as `DropoutWindows`, group layer *
        len(TARGET_MODULES) + target index: the window's seed under which its rows hash as
        positions (`dropout_window_seed`) and its p where the job drops out that target, else 0.
        Built once per step (one small copy to the device)."""
        if self._dropout_windows is None:
            dropping = [w for w in self.windows if w.store.lora_dropout > 0]
            num_layers = max(w.store.num_layers for w in dropping)
            seeds = np.zeros((num_layers * len(TARGET_MODULES), len(dropping)), dtype=np.int64)
            ps = np.zeros(seeds.shape, dtype=np.float32)
            for i, w in enumerate(dropping):
                salts = w.store.dropout_salts()
                seeds[:salts.size, i] = row_seed(salts, w.start).ravel()  # `dropout_window_seed`, vectorized
                on = np.array([t in w.store.dropout_targets for t in TARGET_MODULES])
                ps[:salts.size, i] = np.tile(np.where(on, w.store.lora_dropout, 0.0), w.store.num_layers)
            self._dropout_windows = DropoutWindows.build(
                [(w.flat_start, w.num_tokens) for w in dropping], seeds, ps, device)
        return self._dropout_windows

    def lora_input(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        """The shrink input of a `LoRALinear`: x, with LoRA dropout applied to the rows of
        windows whose job has dropout on this target (their masks go to the stores)."""
        if module.target not in self._dropout_targets:
            return x
        out = x
        for w in self.windows:
            if module.target not in w.store.dropout_targets:
                continue
            if module.layer_idx < 0:
                raise RuntimeError("a LoRALinear without layer_idx: use attach_lora_linears")
            store, layer, target = w.store, module.layer_idx, module.target
            keep = dropout_keep_mask(store.dropout_seed, layer, target, w.start, w.num_tokens,
                                     x.shape[1], store.lora_dropout, x.device)
            if out is x:
                out = x.clone()
            out[w.rows] = apply_lora_dropout(x[w.rows], keep, store.lora_dropout)
            if f"{target}_mask" in store.bitmask_names[layer]:
                store.write_mask(layer, f"{target}_mask", w.start, keep)
            if store.keeps(layer, f"{target}_xd"):
                store.write(layer, f"{target}_xd", w.start, out[w.rows])
        return out

    def take_lora_shrink(self, module: Any, s: torch.Tensor) -> None:
        """A `LoRALinear`'s shrink output s [T, max_rank] (fp32): `{target}_s`, and
        `{target}_delta` where a plan keeps it (recomputed for the window rows only)."""
        layer, s_name, delta_name = module.layer_idx, f"{module.target}_s", f"{module.target}_delta"
        for w in self._keepers.get((layer, s_name), ()):
            w.store.write(layer, s_name, w.start, s[w.rows])
        for w in self._keepers.get((layer, delta_name), ()):
            rank = w.store.graph.tensors[s_name].width
            b = module.lora_b[w.lora_slot, :, :rank].float()
            delta = (s[w.rows, :rank].float() @ b.T) * module.scaling[w.lora_slot]
            w.store.write(layer, delta_name, w.start, delta)

    def take_final(self, stream: torch.Tensor) -> None:
        """The last layer's output stream [T, hidden] of the whole flat batch."""
        self._final = stream

    def final_stream(self, index: int) -> torch.Tensor:
        """Window `index`'s rows of the last layer's output [num_tokens, hidden] (pre-norm)."""
        if self._final is None:
            raise RuntimeError("the forward has not run under this capture yet")
        return self._final[self.windows[index].rows]

"""CUDA graphs for mixed iterations: decode rows, prefill chunks and fine-tuning forward windows.

An eager iteration of Llama-3.1-8B launches about a thousand kernels, each with tens of
microseconds of Python around it: tens of milliseconds of host time, against a few of device
time for a co-serving step. Here the forward of any iteration replays a graph captured for a
bucket (padded tokens T_b, padded rows R_b), vLLM v1's full-graph form for mixed batches:

- every input lives in a static buffer written before the replay: token ids, positions, KV slots
  (-1 for padding tokens: the cache write skips them), query starts and sequence lengths
  (padding rows are empty: query length 0, seq_len 0), block tables, each token's LoRA slot and
  the LoRA segments (padding segments are empty);
- the kernels whose grid followed the batch take tile maps instead (`segment_tile_map`): the
  varlen prefill attention walks (row, query tile) pairs and the SGMV LoRA kernels (segment,
  token tile) pairs from a list of fixed length, so their grid is fixed by the bucket;
- a step with fine-tuning windows writes their activations through `GraphCapture`, whose gather
  and scatter indices are static buffers too (the stores are views of an `ActivationArena`).

Graphs are captured on first use of a key (bucket, which LoRA linears run, which tensors the
windows keep) and kept; the number of keys is bounded by the buckets (reported at start-up) and
the plans of the jobs that run. Padding rows cost the attention kernels nothing (their entries
are not in the tile maps); padding tokens cost the GEMMs their rows.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from flexserve.layers.attention import AttentionMetadata
from flexserve.layers.device_copy import to_device
from flexserve.layers.forward_context import set_forward_context
from flexserve.worker import safe_capture
from flexserve.worker.finetune.graph_capture import GraphCapture, KeptTensor
from flexserve_kernels.lora.serve.meta import LoRAKernelMeta, segment_tile_map

logger = logging.getLogger(__name__)

MIN_TOKENS = 64  # the smallest token bucket; smaller steps pad to it
# (up to, step): token buckets are multiples of `step` up to `up to`; the scheduler aligns a
# co-serving iteration's total to 128 tokens, so it lands on a bucket up to 1024 exactly
TOKEN_STEPS = ((1024, 128), (2048, 256), (4096, 512), (1 << 30, 1024))
ROW_BUCKETS = (8, 32, 128, 512)  # padded row counts (capped at the runner's max_num_rows)
LORA_BLOCK_M = 64  # tokens per SGMV tile under a tile map
MAX_GRAPHS = 256  # captured graphs kept at most; a key past it runs eagerly


def token_buckets(max_num_tokens: int) -> list[int]:
    """Padded token counts: MIN_TOKENS, then multiples of TOKEN_STEPS' steps, then
    max_num_tokens itself."""
    sizes, size = [], MIN_TOKENS
    while size < max_num_tokens:
        sizes.append(size)
        step = next(step for limit, step in TOKEN_STEPS if size < limit)
        size = (size // step + 1) * step
    sizes.append(max_num_tokens)
    return sizes


def row_buckets(max_num_rows: int) -> list[int]:
    """Padded row counts: ROW_BUCKETS below max_num_rows, then max_num_rows itself."""
    return [r for r in ROW_BUCKETS if r < max_num_rows] + [max_num_rows]


def bucket(value: int, sizes: list[int]) -> int | None:
    """The smallest size holding `value`, or None when none does."""
    for size in sizes:
        if size >= value:
            return size
    return None


@dataclass(slots=True)
class MixedStep:
    """One iteration's forward as the graphs see it (host data; built by the model runner)."""

    input_ids: torch.Tensor  # [T] int64 on the device
    metadata: AttentionMetadata  # the step's eager metadata (its device tensors are copied)
    query_lens: np.ndarray  # [R] int64
    row_slots: list[int]  # [R] LoRA slot per row, -1 without
    lora_key: tuple[bool, ...] | None  # which LoRA linears run; None: no LoRA in the step
    lora_slots: frozenset[int]  # the step's adapter slots
    # fine-tuning windows: (kept tensors, src rows, dest arena rows, windows) or None
    capture: tuple[dict[tuple[int, str], KeptTensor], np.ndarray, np.ndarray,
                   list[tuple[int, int]]] | None = None


class MixedGraphRunner:
    """Captures and replays the model's forward for mixed iterations; owns the static inputs."""

    def __init__(self, model: nn.Module, max_num_tokens: int, max_num_rows: int,
                 max_model_len: int, block_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, arena_of=None) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.token_sizes = token_buckets(max_num_tokens)
        self.row_sizes = row_buckets(max_num_rows)
        self.arena_of = arena_of  # () -> the fine-tuning ActivationArena (graph captures)
        # The kernels' launch shapes come from their Triton modules, imported here rather than at
        # the top so that a CPU server, which never builds this runner, runs without Triton.
        from flexserve_kernels.attention.decode import decode_num_splits
        from flexserve_kernels.attention.paged import prefill_block_m

        self._prefill_block_m = prefill_block_m
        max_tokens, max_rows = self.token_sizes[-1], self.row_sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.max_attn_tiles = self._attn_tiles(max_tokens, max_rows)
        self.max_lora_tiles = self._lora_tiles(max_tokens, max_rows)
        like = dict(device=device)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, **like)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, **like)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, **like)
        self.query_start_loc = torch.zeros(max_rows + 1, dtype=torch.int32, **like)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, **like)
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, **like)
        self.attn_tiles = torch.full((2 * self.max_attn_tiles,), -1, dtype=torch.int32, **like)
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, **like)
        self.seg_starts = torch.zeros(max_rows, dtype=torch.int32, **like)
        self.seg_lens = torch.zeros(max_rows, dtype=torch.int32, **like)
        self.seg_slots = torch.zeros(max_rows, dtype=torch.int32, **like)
        self.lora_tiles = torch.full((2 * self.max_lora_tiles,), -1, dtype=torch.int32, **like)
        self.capture_src = torch.zeros(max_tokens, dtype=torch.long, **like)
        self.capture_dest = torch.zeros(max_tokens, dtype=torch.long, **like)
        self.capture_count = torch.zeros(1, dtype=torch.int32, **like)
        self.num_splits = {
            r: decode_num_splits(r, num_kv_heads, max_model_len, device) for r in self.row_sizes}
        # key -> (graph, its output, its capture); CPU runs record keys only (no graphs)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None,
                                       GraphCapture | None]] = {}
        self.eager_keys: set[tuple] = set()  # keys whose capture failed: they run eagerly
        self._warm_variants: set[tuple] = set()  # (lora key, kept key) warmed up in a capture
        self.pool = None
        self.capture_seconds = 0.0
        self.num_replays_by_kind = {"plain": 0, "capture": 0}  # steps run, with windows or not
        logger.info("mixed-iteration CUDA graphs: token buckets %s, row buckets %s, captured on "
                    "first use (at most %d)", self.token_sizes, self.row_sizes, MAX_GRAPHS)

    # ------------------------------------------------------------------------------ buckets
    def _attn_block_m(self, num_tokens: int) -> int:
        return self._prefill_block_m(self.head_dim, self.dtype, num_tokens)

    def _attn_tiles(self, num_tokens: int, num_rows: int) -> int:
        return -(-num_tokens // self._attn_block_m(num_tokens)) + num_rows

    def _lora_tiles(self, num_tokens: int, num_rows: int) -> int:
        return -(-num_tokens // LORA_BLOCK_M) + num_rows

    def key_for(self, step: MixedStep) -> tuple | None:
        """The graph key of a step, or None when no bucket holds it."""
        num_tokens, num_rows = step.input_ids.shape[0], len(step.query_lens)
        tokens = bucket(num_tokens, self.token_sizes)
        rows = bucket(num_rows, self.row_sizes)
        if tokens is None or rows is None or step.metadata.max_seq_len > self.max_model_len:
            return None
        if step.metadata.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        kept = None if step.capture is None else _kept_key(step.capture[0])
        key = (tokens, rows, step.lora_key, kept)
        if key not in self.graphs and len(self.graphs) >= MAX_GRAPHS:
            return None
        return key

    # ------------------------------------------------------------------------------- inputs
    def _write_inputs(self, step: MixedStep, tokens: int, rows: int) -> None:
        md = step.metadata
        num_tokens, num_rows = step.input_ids.shape[0], len(step.query_lens)
        self.input_ids[:num_tokens].copy_(step.input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(md.positions, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(md.slot_mapping, non_blocking=True)
        self.query_start_loc[:num_rows + 1].copy_(md.query_start_loc, non_blocking=True)
        self.seq_lens[:num_rows].copy_(md.seq_lens, non_blocking=True)
        width = md.block_tables.shape[1]
        self.block_tables[:num_rows, :width].copy_(md.block_tables, non_blocking=True)
        if tokens > num_tokens:
            self.slot_mapping[num_tokens:tokens].fill_(-1)
            self.token_slots[num_tokens:tokens].fill_(-1)
        # Host-built: padding rows, the attention and LoRA tile maps, segments, capture indices,
        # in one int32 and one int64 copy.
        q_lens = step.query_lens
        ints = [np.full(rows - num_rows, num_tokens, dtype=np.int32)]  # padding query starts
        attn_tiles = self._attn_tiles(tokens, rows)
        ints.append(segment_tile_map(np.where(q_lens > 1, q_lens, 0), self._attn_block_m(tokens),
                                     attn_tiles, last_tile_first=True).ravel())
        lora = step.lora_key is not None
        if lora:
            starts, lens, slots, token_slots = _padded_segments(q_lens, step.row_slots, rows, tokens)
            ints += [starts, lens, slots]
            ints.append(segment_tile_map(lens, LORA_BLOCK_M, self._lora_tiles(tokens, rows)).ravel())
            ints.append(token_slots)
        packed32 = to_device(torch.from_numpy(np.concatenate(ints)), self.device)
        offset = 0

        def take(n: int) -> torch.Tensor:
            nonlocal offset
            offset += n
            return packed32[offset - n:offset]

        self.query_start_loc[num_rows + 1:rows + 1].copy_(take(rows - num_rows))
        self.seq_lens[num_rows:rows].zero_()
        self.attn_tiles[:2 * attn_tiles].copy_(take(2 * attn_tiles))
        if lora:
            self.seg_starts[:rows].copy_(take(rows))
            self.seg_lens[:rows].copy_(take(rows))
            self.seg_slots[:rows].copy_(take(rows))
            lora_tiles = self._lora_tiles(tokens, rows)
            self.lora_tiles[:2 * lora_tiles].copy_(take(2 * lora_tiles))
            self.token_slots[:num_tokens].copy_(take(num_tokens))
        if step.capture is not None:
            _, src, dest, _ = step.capture
            index = np.zeros(2 * tokens + 1, dtype=np.int64)
            index[:len(src)] = src
            index[tokens:tokens + len(dest)] = dest
            index[tokens + len(dest):] = self.arena_of().dump_row
            index[-1] = len(src)
            packed64 = to_device(torch.from_numpy(index), self.device)
            self.capture_src[:tokens].copy_(packed64[:tokens])
            self.capture_dest[:tokens].copy_(packed64[tokens:2 * tokens])
            self.capture_count.copy_(packed64[-1:])

    def _metadata(self, tokens: int, rows: int, step: MixedStep) -> AttentionMetadata:
        attn_tiles = self._attn_tiles(tokens, rows)
        # The torch path (CPU) attends the real rows' padded groups; padding tokens get none.
        row_groups = [] if step.metadata is None else [
            g if g.token_index is not None else dataclasses.replace(
                g, token_index=torch.arange(step.input_ids.shape[0], device=self.device))
            for g in step.metadata.row_groups]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens],
            positions=self.positions[:tokens],
            query_start_loc=self.query_start_loc[:rows + 1],
            seq_lens=self.seq_lens[:rows],
            block_tables=self.block_tables[:rows],
            max_query_len=tokens,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            row_groups=row_groups,
            decode_num_splits=self.num_splits[rows],
            num_decode_rows=None,
            prefill_tile_map=self.attn_tiles[:2 * attn_tiles].view(2, attn_tiles),
            prefill_block_m=self._attn_block_m(tokens),
        )

    def _lora_meta(self, tokens: int, rows: int, slots: frozenset[int]) -> LoRAKernelMeta:
        lora_tiles = self._lora_tiles(tokens, rows)
        return LoRAKernelMeta(
            token_slots=self.token_slots[:tokens], seg_starts=self.seg_starts[:rows],
            seg_lens=self.seg_lens[:rows], seg_slots=self.seg_slots[:rows], num_tokens=tokens,
            max_seg_len=tokens, decode_only=False, slots=slots,
            tile_map=self.lora_tiles[:2 * lora_tiles].view(2, lora_tiles),
            tile_block_m=LORA_BLOCK_M)

    # ----------------------------------------------------------------------- capture, replay
    def _forward(self, tokens: int, rows: int, step: MixedStep,
                 capture: GraphCapture | None) -> torch.Tensor:
        lora_meta = None
        if step.lora_key is not None:
            lora_meta = self._lora_meta(tokens, rows, step.lora_slots)
        with set_forward_context(self._metadata(tokens, rows, step), lora_meta,
                                 finetune=capture):
            return self.model(self.input_ids[:tokens], self.positions[:tokens])

    def _new_capture(self, tokens: int, step: MixedStep) -> GraphCapture | None:
        if step.capture is None:
            return None
        return GraphCapture(self.arena_of(), step.capture[0], self.capture_src[:tokens],
                            self.capture_dest[:tokens], self.capture_count)

    def _capture(self, key: tuple, step: MixedStep, log: bool = True, warmups: int = 2) -> None:
        tokens, rows = key[0], key[1]
        start = time.perf_counter()
        capture = self._new_capture(tokens, step)
        # The step's own inputs are in the buffers: warm-up forwards compute on real data and
        # write the same K/V and activations the replay will write again.
        if warmups:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(warmups):  # compile the Triton kernels and warm cuBLAS outside
                    self._forward(tokens, rows, step, capture)  # the capture
            torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        out = safe_capture.capture(
            graph, self.pool, lambda: self._forward(tokens, rows, step, capture), self.device)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, out, capture)
        seconds = time.perf_counter() - start
        self.capture_seconds += seconds
        if log:
            logger.info("captured a mixed-iteration CUDA graph (%d tokens, %d rows%s%s) in %.2f s; "
                        "%d graphs", tokens, rows, ", LoRA" if step.lora_key else "",
                        ", fine-tuning capture" if capture is not None else "", seconds,
                        len(self.graphs))

    def precapture(self, lora_key: tuple[bool, ...] | None = None,
                   lora_slots: frozenset[int] = frozenset(),
                   kept: dict[tuple[int, str], KeptTensor] | None = None) -> int:
        """Capture the graph of every bucket for one (LoRA linears, kept tensors) variant now,
        on padding inputs (no KV, LoRA or arena write happens), so serving never stalls on a
        capture or a kernel compile; returns how many it captured."""
        start, count = time.perf_counter(), 0
        self._write_padding()
        step = MixedStep(self.input_ids[:0], None, np.zeros(0, np.int64), [], lora_key,
                         lora_slots, None if kept is None else (kept, None, None, []))
        variant = (lora_key, None if kept is None else _kept_key(kept))
        for tokens in self.token_sizes:
            for fewer, rows in zip([0] + self.row_sizes, self.row_sizes):
                if fewer >= tokens:
                    continue  # no step has more rows than tokens
                key = (tokens, rows, *variant)
                if key in self.graphs or key in self.eager_keys or len(self.graphs) >= MAX_GRAPHS:
                    continue
                if self.device.type == "cuda":
                    # Warm-up forwards compile kernels and warm cuBLAS for new shapes: a bucket
                    # whose plain graph exists has its shapes warm, and once one bucket of this
                    # variant ran its LoRA and capture kernels are compiled, so its other
                    # buckets are captured without (a job's start then costs the captures, not
                    # three forwards of every bucket).
                    warm = variant not in self._warm_variants or \
                        (tokens, rows, None, None) not in self.graphs
                    try:
                        self._capture(key, step, log=False, warmups=2 if warm else 0)
                        self._warm_variants.add(variant)
                    except safe_capture.CaptureFailed as e:
                        logger.warning("mixed iterations of %d tokens and %d rows run eagerly: "
                                       "%s", tokens, rows, e)
                        self.eager_keys.add(key)
                        self.pool = None  # torch refuses the failed capture's pool
                        continue
                else:  # the padded forward runs, with no graph to keep (tests)
                    self._forward(tokens, rows, step, self._new_capture(tokens, step))
                    self.graphs[key] = (None, None, None)
                count += 1
        logger.info("captured %d mixed-iteration CUDA graphs%s%s in %.1f s", count,
                    " with LoRA" if lora_key else "", " with a fine-tuning capture" if kept else "",
                    time.perf_counter() - start)
        return count

    def _write_padding(self) -> None:
        """Static inputs of an empty step: no token writes the KV cache or the arena, no row or
        LoRA segment has work."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        self.query_start_loc.zero_()
        self.attn_tiles.fill_(-1)
        self.lora_tiles.fill_(-1)
        self.token_slots.fill_(-1)
        self.seg_lens.zero_()
        self.capture_count.zero_()

    def drop_captures(self) -> None:
        """Forget the graphs that write fine-tuning activations (the arena they wrote is gone)."""
        for key in [k for k in self.graphs if k[3] is not None]:
            del self.graphs[key]
        self.eager_keys = {k for k in self.eager_keys if k[3] is None}

    def run(self, step: MixedStep, key: tuple) -> tuple[torch.Tensor, GraphCapture | None]:
        """Replay (capturing first if new) the graph of `key` for this step: the hidden states
        [T, hidden] (a view of the graph's output, valid until the next replay) and, with
        windows, the capture whose `final_stream` gives their last-layer rows."""
        tokens, rows = key[0], key[1]
        self.num_replays_by_kind["plain" if step.capture is None else "capture"] += 1
        self._write_inputs(step, tokens, rows)
        if self.device.type == "cuda" and key not in self.graphs and key not in self.eager_keys:
            try:
                self._capture(key, step)
            except safe_capture.CaptureFailed as e:
                logger.warning("mixed iterations of %d tokens and %d rows run eagerly: %s",
                               tokens, rows, e)
                self.eager_keys.add(key)
                self.pool = None  # torch refuses the failed capture's pool
        if self.device.type != "cuda" or key in self.eager_keys:
            # The same padded forward without a graph (CPU, or a failed capture).
            capture = self._new_capture(tokens, step)
            out = self._forward(tokens, rows, step, capture)
            if self.device.type != "cuda":
                self.graphs.setdefault(key, (None, None, None))
        else:
            graph, out, capture = self.graphs[key]
            graph.replay()
        if capture is not None:
            capture.windows = step.capture[3]
        return out[:step.input_ids.shape[0]], capture


def _kept_key(kept: dict[tuple[int, str], KeptTensor]) -> tuple:
    """The hashable form of a capture's kept tensors (part of a graph key)."""
    return tuple(sorted((k, v.width, str(v.dtype)) for k, v in kept.items()))


def _padded_segments(q_lens: np.ndarray, row_slots: list[int], rows: int, tokens: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`_segments` with the segment arrays padded to `rows` entries for a graph of `tokens`
    tokens: the padding segments hold no token and start at `tokens`, past every token, so the
    starts stay sorted for `token_segments`' binary search (the fused LoRA kernels' mixed row
    tiles)."""
    starts, lens, slots, token_slots = _segments(q_lens, row_slots)
    pad = rows - len(lens)
    return (np.concatenate([starts, np.full(pad, tokens, np.int32)]),
            np.concatenate([lens, np.zeros(pad, np.int32)]),
            np.concatenate([slots, np.zeros(pad, np.int32)]), token_slots)


def _segments(q_lens: np.ndarray, row_slots: list[int]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(seg_starts, seg_lens, seg_slots, token_slots) int32 of rows: consecutive rows of one slot
    merge into one segment, rows without an adapter form none (as `LoRAKernelMeta.build`)."""
    slots = np.asarray(row_slots, dtype=np.int64)
    ends = np.cumsum(q_lens)
    starts = ends - q_lens
    token_slots = np.repeat(slots, q_lens).astype(np.int32)
    has = slots >= 0
    # a row continues the previous segment when it has the same slot
    new_seg = has & ~(np.concatenate([[False], has[:-1]]) & (slots == np.roll(slots, 1)))
    seg_of_row = np.cumsum(new_seg) - 1
    num_segs = int(new_seg.sum())
    seg_starts = starts[new_seg].astype(np.int32)
    seg_lens = np.zeros(num_segs, dtype=np.int64)
    np.add.at(seg_lens, seg_of_row[has], q_lens[has])
    return seg_starts, seg_lens.astype(np.int32), slots[new_seg].astype(np.int32), token_slots

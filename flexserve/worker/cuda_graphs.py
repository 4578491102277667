"""CUDA graphs for decode-only iterations: one captured forward per padded batch size.

A decode step of B rows (one new token each) costs hundreds of kernel launches (about 450 for
Llama-3.1-8B with LoRA on every projection); replaying a captured graph turns them into one launch.
Graphs are captured once, after the KV cache is bound, for padded batch sizes 1, 2, 4, 8, 16, 32,
48, ... up to `max_num_seqs`, each with and without the LoRA kernels: the key is (padded batch
size, whether any row has an adapter). The number of distinct adapters need not be in the key: the
BGMV kernels a decode step uses read each token's slot from device memory and launch one program
per token whatever the adapters, so one graph serves any mix of slots (slot weights are copied
into the same buffers in place).

Every input of the captured forward lives in a static device buffer, written before each replay:
token ids, positions, KV slots, sequence lengths, block tables (as wide as max_model_len needs) and
each token's adapter slot. Padding rows have seq_len 0 (decode attention writes zeros for them),
KV slot -1 (the cache write skips them) and adapter slot -1. Decode attention runs with a fixed
number of splits chosen for max_model_len, so the grid does not change as contexts grow.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
from torch import nn

from flexserve.layers.attention import AttentionMetadata
from flexserve.layers.forward_context import set_forward_context
from flexserve.worker import safe_capture
from flexserve_kernels.lora.serve.meta import LoRAKernelMeta

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then every 16 up to max_num_seqs (inclusive)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


def padded_batch_size(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding `num_rows`, or None when none does."""
    for size in sizes:
        if size >= num_rows:
            return size
    return None


class CUDAGraphRunner:
    """Captures and replays the model's decode-only forward; owns the static input buffers."""

    def __init__(
        self,
        model: nn.Module,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        num_kv_heads: int,
        device: torch.device,
        with_lora: bool,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.with_lora = with_lora
        max_rows = self.batch_sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_rows,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self.token_slots = torch.full((max_rows,), -1, dtype=torch.int32, device=device)
        # Triton's module is imported here, not at the top: a CPU server runs without Triton.
        from flexserve_kernels.attention.decode import decode_num_splits

        self.num_splits = {
            b: decode_num_splits(b, num_kv_heads, max_model_len, device) for b in self.batch_sizes
        }
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.pool = None

    # ------------------------------------------------------------------------------------ capture
    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            positions=self.positions[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            row_groups=[],
            decode_num_splits=self.num_splits[batch],
        )

    def _lora_meta(self, batch: int, with_lora: bool) -> LoRAKernelMeta | None:
        if not with_lora:
            return None
        empty = self.token_slots[:0]
        # BGMV reads token_slots only; the segment fields are unused by a decode-only batch.
        return LoRAKernelMeta(
            token_slots=self.token_slots[:batch], seg_starts=empty, seg_lens=empty,
            seg_slots=empty, num_tokens=batch, max_seg_len=1, decode_only=True,
        )

    def _forward(self, batch: int, with_lora: bool) -> torch.Tensor:
        with set_forward_context(self._metadata(batch), self._lora_meta(batch, with_lora)):
            return self.model(self.input_ids[:batch], self.positions[:batch])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch size, LoRA) graph, largest first so smaller ones reuse its pool."""
        start = time.perf_counter()
        # Padding everywhere: seq_len 0 and slot -1 make a capture touch no KV cache entry.
        self.seq_lens.zero_()
        self.slot_mapping.fill_(-1)
        self.token_slots.fill_(-1)
        keys = [(b, lora) for b in reversed(self.batch_sizes)
                for lora in ((False, True) if self.with_lora else (False,))]
        for batch, lora in keys:
            for _ in range(2):  # compile the Triton kernels and warm cuBLAS outside the capture
                self._forward(batch, lora)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            out = safe_capture.capture(graph, self.pool, functools.partial(self._forward, batch, lora),
                                       self.device)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[(batch, lora)] = graph
            self.outputs[(batch, lora)] = out
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs (batch sizes %s%s) in %.1f s", len(self.graphs),
                    self.batch_sizes, ", with and without LoRA" if self.with_lora else "",
                    time.perf_counter() - start)

    # ------------------------------------------------------------------------------------- replay
    def can_run(self, num_rows: int, max_seq_len: int) -> bool:
        """Whether a decode-only step of num_rows rows fits a captured graph."""
        return bool(self.graphs) and num_rows <= self.batch_sizes[-1] and max_seq_len <= self.max_model_len

    def run(
        self,
        input_ids: torch.Tensor,
        metadata: AttentionMetadata,
        lora_meta: LoRAKernelMeta | None,
    ) -> torch.Tensor:
        """Replay the graph for this decode-only step; returns hidden states [num_rows, hidden]
        (a view of the graph's output buffer, valid until the next replay)."""
        num_rows = metadata.num_rows
        batch = padded_batch_size(num_rows, self.batch_sizes)
        with_lora = lora_meta is not None and lora_meta.has_lora
        self.input_ids[:num_rows].copy_(input_ids, non_blocking=True)
        self.positions[:num_rows].copy_(metadata.positions, non_blocking=True)
        self.slot_mapping[:num_rows].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:num_rows].copy_(metadata.seq_lens, non_blocking=True)
        width = metadata.block_tables.shape[1]
        self.block_tables[:num_rows, :width].copy_(metadata.block_tables, non_blocking=True)
        if batch > num_rows:
            self.seq_lens[num_rows:batch].zero_()
            self.slot_mapping[num_rows:batch].fill_(-1)
        if with_lora:
            self.token_slots[:num_rows].copy_(lora_meta.token_slots, non_blocking=True)
            self.token_slots[num_rows:batch].fill_(-1)
        self.graphs[(batch, with_lora)].replay()
        return self.outputs[(batch, with_lora)][:num_rows]

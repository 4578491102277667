"""The generative loss of one fine-tuning forward window (FlexLLM algorithm 2, line 10) and where
the backward starts: its gradient with respect to the last decoder layer's output.

Convention (HF's shifted labels): logits at position p predict token p + 1, and loss_mask[p + 1]
says whether that target counts. Only rows with a counted target get logits, at most `chunk_rows`
of them at a time, so a long window never holds [window, vocab] logits. The final RMSNorm and
lm_head are frozen: their backward gives dL/dx_N only.

The log-softmax runs in a dtype wider than the model's (fp32 for bf16/fp16 models, fp64 for fp32
ones): summed over a ~50K vocabulary it limits the precision of the whole gradient. SmolLM2 in
fp32 (x86 CPU, torch 2.13): adapter gradients 1.5e-5 off an fp64 reference with an fp32
log-softmax, 7.8e-6 with fp64; HF + PEFT in fp32 are 1.9e-5 off the same reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from flexserve.distributed.parallel_state import TensorParallelGroup
from flexserve.layers.device_copy import HostCopy, to_device
from flexserve.worker.finetune.layer_backward import rmsnorm_backward, rmsnorm_forward

DEFAULT_CHUNK_ROWS = 1024
# Chunks get zero rows up to this many. x86 MKL's fp32 GEMV (one row) sums the vocabulary
# reduction ~5x less accurately than its GEMM (1.7e-6 vs 3.2e-7 relative for [1, 49152] @
# [49152, 576], torch 2.13), and the softmax - onehot cancellation of the loss gradient
# amplifies that: dL/dx_N of SmolLM2 came out 2.5e-5 off an fp64 reference with a one-token
# window, 1.5e-6 with the padding, which costs nothing measurable (lm_head is read once anyway).
MIN_GEMM_ROWS = 8


class SequenceTargets:
    """A sequence's counted targets, found once: the positions p whose next token counts
    (loss_mask[p + 1]) and those tokens, on the host (to find a window's share by bisection)
    and on the device (sliced per window: a window costs no host pass over its tokens and no
    copy to the device)."""

    def __init__(self, token_ids: Sequence[int], loss_mask: Sequence[bool],
                 device: torch.device | str) -> None:
        if len(loss_mask) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens with {len(loss_mask)} mask entries")
        self.num_tokens = len(token_ids)
        mask = np.asarray(loss_mask, dtype=bool)[1:]
        self.positions = np.flatnonzero(mask).astype(np.int64)
        ids = np.asarray(token_ids, dtype=np.int64)
        self._positions = to_device(torch.from_numpy(self.positions), device)
        self._targets = to_device(torch.from_numpy(ids[1:][mask]), device)

    def window(self, start: int, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(window rows, target ids) of the counted targets of window [start, start + n), on
        the device, int64; (None, None) when none counts. ValueError when it does not fit."""
        if not 0 <= start <= self.num_tokens - n:
            raise ValueError(f"window [{start}, {start + n}) does not fit {self.num_tokens} "
                             "tokens")
        first, last = (int(i) for i in np.searchsorted(self.positions, (start, start + n)))
        if first == last:
            return None, None
        return self._positions[first:last] - start, self._targets[first:last]


def _accumulators(weight: torch.Tensor, device: torch.device
                  ) -> tuple[torch.dtype, torch.Tensor, torch.Tensor]:
    """The log-softmax dtype (wider than the model's), a zero loss sum and a zero count."""
    loss_dtype = torch.float64 if weight.dtype == torch.float32 else torch.float32
    return (loss_dtype, torch.zeros((), dtype=loss_dtype, device=device),
            torch.zeros((), dtype=torch.int64, device=device))


def _chunks(source: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, chunk_rows: int):
    """(window rows, their targets, the rows of `source` padded to MIN_GEMM_ROWS) per chunk."""
    for first in range(0, rows.shape[0], chunk_rows):
        index = rows[first:first + chunk_rows]
        x = source.index_select(0, index)
        yield index, targets[first:first + chunk_rows], F.pad(
            x, (0, 0, 0, max(0, MIN_GEMM_ROWS - index.shape[0])))


@dataclass(slots=True)
class VocabShard:
    """The rows of lm_head this rank holds: vocabulary ids [first, first + valid); all of them
    on one rank. Under tensor parallelism (the last rank's rows past the vocabulary are padding)
    the cross-entropy is Megatron-LM's vocab-parallel one: the ranks agree on each row's maximum
    and exp-sum and on its target's logit with all-reduces of one value per row, never
    gathering logits; on one rank those all-reduces are no-ops."""

    tp: Any
    first: int
    valid: int

    @classmethod
    def of(cls, model: Any) -> VocabShard:
        tp = getattr(model, "tp", None)
        if tp is None or tp.world_size == 1:
            return cls(TensorParallelGroup(), 0, model.lm_head.weight.shape[0])
        layout = model.layout
        return cls(tp, layout.vocab_start, max(0, layout.vocab_end - layout.vocab_start))

    def num_correct(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """How many rows' argmax over the whole vocabulary is their target (the first of equal
        maxima, as `argmax` on one rank)."""
        if self.tp.world_size == 1:
            return (logits.argmax(dim=-1) == targets).sum()
        n = logits.shape[0]
        big = torch.iinfo(torch.int64).max
        if self.valid:
            best, where = logits[:, :self.valid].max(dim=-1)
            best = best.float()
        else:
            best = torch.full((n,), float("-inf"), device=logits.device)
            where = torch.zeros(n, dtype=torch.int64, device=logits.device)
        top = self.tp.all_reduce(best.clone(), "max")
        first = torch.where(best == top, where + self.first, torch.full_like(where, big))
        return (self.tp.all_reduce(first, "min") == targets).sum()

    def loss_and_grad(self, logits: torch.Tensor, targets: torch.Tensor,
                      loss_dtype: torch.dtype, grad_scale: float | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the summed cross-entropy of the first len(targets) rows, grad_scale x its gradient
        with respect to `logits`, written into `logits` in their dtype and zero on the other
        rows; None when grad_scale is None), computed in `loss_dtype`.

        The softmax runs in place in one wide copy, whose model-dtype source then takes the
        gradient: 6 bytes per logit at once for bf16 (1024 rows of Llama 3's 128,256: 0.79 GB),
        where log_softmax, exp and a cast would hold 10 (1.31 GB). The same math as
        log_softmax: log p = (x - max) - log(sum(exp(x - max)))."""
        num = targets.shape[0]
        wide = logits.to(loss_dtype)
        if self.tp.world_size == 1:  # every target is a column here
            local, here = targets[:, None], None
        else:
            local = targets - self.first
            here = ((local >= 0) & (local < self.valid))[:, None]
            local = local.clamp(0, logits.shape[1] - 1)[:, None]
            wide[:, self.valid:] = float("-inf")
        wide.sub_(self.tp.all_reduce(wide.amax(dim=-1, keepdim=True), "max"))
        shifted = wide[:num].gather(1, local)
        if here is not None:
            shifted = self.tp.all_reduce(torch.where(here, shifted, torch.zeros_like(shifted)))
        wide.exp_()
        sums = self.tp.all_reduce(wide.sum(dim=-1, keepdim=True))
        loss = -(shifted - sums[:num].log()).sum()
        if grad_scale is None:
            return loss, None
        # d CE / d logits = softmax - onehot(target); padding rows get none
        wide.div_(sums)
        wide[num:] = 0.0
        wide[:num].scatter_add_(1, local, torch.full_like(shifted, -1.0) if here is None
                                else -here.to(loss_dtype))
        torch.mul(wide, grad_scale, out=logits)  # the model-dtype gradient, cast once
        return loss, logits


@dataclass(slots=True)
class WindowLoss:
    """The loss of one window, unscaled."""

    loss_sum: float  # sum of the cross-entropy of the window's counted targets (nats)
    num_tokens: int  # how many targets counted
    num_correct: int = 0  # counted targets that are the argmax of their logits (accuracy)


@dataclass(slots=True)
class PendingWindowLoss:
    """A window's loss still on the device: its work is queued, nothing waited for. A step reads
    all of its windows' losses at once (`copy_window_losses`), with one device-to-host copy."""

    sums: torch.Tensor | None  # [2] on the device: the cross-entropy sum, the correct count
    num_tokens: int  # how many targets counted (known on the host)


@dataclass(slots=True)
class WindowLossCopy:
    """Window losses on their way to the host (`HostCopy`: `read` waits for their copy only)."""

    pending: list[PendingWindowLoss]
    copy: HostCopy | None  # [windows with sums, 2]

    def read(self) -> list[WindowLoss]:
        values = iter(self.copy.tolist() if self.copy is not None else [])
        results = []
        for p in self.pending:
            if p.sums is None:
                results.append(WindowLoss(0.0, 0))
            else:
                loss_sum, correct = next(values)
                results.append(WindowLoss(loss_sum, p.num_tokens, int(correct)))
        return results


def copy_window_losses(pending: Sequence[PendingWindowLoss]) -> WindowLossCopy:
    """Start the copy of `pending` windows' losses to the host, one copy for them all."""
    on_device = [p.sums for p in pending if p.sums is not None]
    return WindowLossCopy(list(pending), HostCopy(torch.stack(on_device)) if on_device else None)


def window_loss_async(
    model: Any,
    stream: torch.Tensor,
    targets: SequenceTargets,
    start: int,
    grad_out: torch.Tensor,
    grad_scale: float,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> PendingWindowLoss:
    """Cross-entropy of a window and grad_scale x its gradient w.r.t. the window's stream.

    stream [n, hidden]: the last layer's output (before the final norm) at positions
    [start, start + n) of a sequence whose counted targets are `targets`.
    grad_out [n, hidden] fp32 (the window's rows of the sequence's residual-gradient buffer)
    receives grad_scale * d(sum of the window's CE)/d(stream), zero on rows without a target;
    grad_scale is 1 / (loss tokens of the whole step) for a mean loss. Also counts the targets
    that are their row's argmax (each row's own logits: exact whatever the window split). Nothing
    is waited for: the sum and the count stay on the device until read.
    """
    n, hidden = stream.shape
    if tuple(grad_out.shape) != (n, hidden) or grad_out.dtype != torch.float32:
        raise ValueError(f"grad_out must be fp32 [{n}, {hidden}], got {grad_out.dtype} "
                         f"{tuple(grad_out.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    rows, target_ids = targets.window(start, n)
    grad_out.zero_()
    if rows is None:
        return PendingWindowLoss(None, 0)
    norm, weight = model.model.norm, model.lm_head.weight
    loss_dtype, total, correct = _accumulators(weight, stream.device)
    vocab = VocabShard.of(model)
    for index, chunk_targets, x in _chunks(stream, rows, target_ids, chunk_rows):
        num = index.shape[0]
        logits = F.linear(rmsnorm_forward(x, norm.weight, norm.variance_epsilon), weight)
        correct += vocab.num_correct(logits[:num], chunk_targets)
        loss, grad_logits = vocab.loss_and_grad(logits, chunk_targets, loss_dtype, grad_scale)
        total += loss
        # under tensor parallelism each rank's lm_head rows give a share of dL/dhidden
        grad_hidden = vocab.tp.all_reduce((grad_logits @ weight).float())
        del logits, grad_logits  # before the next chunk's logits exist
        grad = rmsnorm_backward(x, norm.weight, norm.variance_epsilon, grad_hidden)
        grad_out.index_copy_(0, index, grad[:num])
    return PendingWindowLoss(torch.stack([total, correct.to(loss_dtype)]), rows.shape[0])


def window_logprob_sum_async(
    model: Any,
    hidden: torch.Tensor,
    targets: SequenceTargets,
    start: int,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> PendingWindowLoss:
    """The cross-entropy of a window's counted targets with no gradient: a DPO reference window.

    hidden [n, hidden]: the model's final hidden states (after the final norm) at positions
    [start, start + n). The same targets, wide log-softmax and chunking as `window_loss`; the
    summed log-probability of the targets is -loss_sum.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    rows, target_ids = targets.window(start, hidden.shape[0])
    if rows is None:
        return PendingWindowLoss(None, 0)
    weight = model.lm_head.weight
    loss_dtype, total, correct = _accumulators(weight, hidden.device)
    vocab = VocabShard.of(model)
    for index, chunk_targets, x in _chunks(hidden, rows, target_ids, chunk_rows):
        logits = F.linear(x, weight)[:index.shape[0]]
        correct += vocab.num_correct(logits, chunk_targets)
        total += vocab.loss_and_grad(logits, chunk_targets, loss_dtype, None)[0]
        del logits
    return PendingWindowLoss(torch.stack([total, correct.to(loss_dtype)]), rows.shape[0])

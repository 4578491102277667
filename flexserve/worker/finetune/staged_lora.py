"""The adapters of several fine-tuning jobs staged side by side, so that one backward window runs
rows of all of them (MuxTune's batched backward, its eq. 2: the frozen dX GEMMs run once over
every job's rows; only the adapter math is routed per job).

Up to `width` jobs of one plan (one LoRA rank r, one set of targets) each get a block of r
columns: per target, A_cat [width * r, in] holds their A's stacked, B_cat [out, width * r] their
B's side by side, and scale [width * r] each job's scaling over its block. A row of job j keeps
only block j of anything rank-wide, by a [rows, width * r] mask (`torch.where`, so another
block's value, even a non-finite one, becomes an exact zero):

    S = mask(x A_cat^T)                     (each row's own adapter's shrink, zeros elsewhere)
    dB_cat += (dY^T S) * scale              (block j: the sum over job j's rows only)
    dS = mask((dY B_cat) * scale)
    dA_cat += dS^T x,   dX_lora = dS A_cat

Every block of dB_cat and dA_cat is the sum over its own job's rows, exactly the gradient of
that job's windows run alone (in another summation order), and every row's dX is its own
adapter's. The LoRA products are `width` times wider (rank-16 blocks of 8 jobs: 128 columns,
by the FLOP count ~10% of an 8B layer's frozen dX FLOPs on all projections).

Where the fused LoRA kernels run (`SequenceBackward.lora_kernel_paths`), the LoRA math skips
the rank-wide products: each job's rows are one segment of the kernels' routing
(`kernel_meta`: one segment per job, so `load` wants each job's rows contiguous), S and
dS stay rank r, and kernels 1 and 3-5 read and add to each row's own block only, as with many
adapters in one batch (MuxTune's batched backward with LoRAFusion's multi-adapter kernels).

Isolation: a job whose values went non-finite must not spread them through the weight-gradient
sums, which add over every job's rows (0 * nan is nan). Non-finite values can enter a window in
four places, each checked as it enters (`admit`): the staged weights (taken with non-finite
values as zero), the rows' output gradients and the attention gradients (a row with a
non-finite value is zeroed) and the rows' stored activations (such a row reads the arena's dump
row instead, written only by padding). The job of such a row is marked: its gradients get a NaN
at unstaging, so its optimizer step fails it, as it would have alone, while the others' sums
stay exact. A row whose values overflow inside the window marks its job too.
"""

from __future__ import annotations

import torch

from flexserve.layers.lora_linear import LoRALinear
from flexserve_kernels.lora.serve.meta import LoRAKernelMeta


class StagedLoRA:
    """The staged adapters of up to `width` jobs of one plan (rank `rank`, `targets` with their
    (in, out) sizes), with their gradient buffers and the row mask of the window being run.

    Host work per window is a few copies: the jobs' LoRA slots into a static index and each
    row's job into a static row map (`load`), and one multi-tensor add of every job's gradient
    blocks into its own buffers (`unstage`). The adapters are gathered from the slots inside the
    pieces (`gather`, captured with them), and each job's blocks of dA and dB are contiguous
    ([width, r, in] and [width, out, r])."""

    def __init__(self, width: int, rank: int, shapes: dict[str, tuple[int, int]],
                 max_rows: int, dtype: torch.dtype, device: torch.device) -> None:
        if width < 2:
            raise ValueError(f"staging is for 2 or more jobs, got width {width}")
        self.width, self.rank = width, rank
        cols = width * rank
        self.a = {t: torch.zeros(cols, n_in, dtype=dtype, device=device)
                  for t, (n_in, _) in shapes.items()}
        self.b = {t: torch.zeros(n_out, cols, dtype=dtype, device=device)
                  for t, (_, n_out) in shapes.items()}
        self.scale = {t: torch.zeros(cols, device=device) for t in shapes}
        self.grad_a = {t: torch.zeros(cols, n_in, device=device) for t, (n_in, _) in shapes.items()}
        self.grad_b_blocks = {t: torch.zeros(width, n_out, rank, device=device)
                              for t, (_, n_out) in shapes.items()}
        self.slots = torch.zeros(width, dtype=torch.long, device=device)  # block -> LoRA slot
        # block of each row (rows past the window's: none) and its rank-wide mask
        self.row_block = torch.full((max_rows,), -1, dtype=torch.long, device=device)
        self.mask = torch.zeros(max_rows, cols, dtype=torch.bool, device=device)
        self._block_of_col = torch.arange(cols, device=device) // rank
        self._blocks = torch.arange(width, device=device)
        # NaN where a job's rows went non-finite, 0 elsewhere (per block)
        self.poison = torch.zeros(width, device=device)
        # The fused LoRA kernels' routing: (first row, rows, block) of each job's segment in row
        # order, each row's block as int32, and each block's scaling
        self.segments = torch.zeros(3, width, dtype=torch.int32, device=device)
        self.token_blocks = torch.full((max_rows,), -1, dtype=torch.int32, device=device)
        self.block_scale = {t: torch.zeros(width, device=device) for t in shapes}

    # ------------------------------------------------------------------ inside the pieces
    def gather(self, modules: dict[str, LoRALinear]) -> None:
        """The adapters of the blocks' LoRA slots (`load`) of one layer's `modules` (target ->
        LoRALinear) into the staged weights, non-finite values as zero; the marks cleared."""
        r, w = self.rank, self.width
        for target, module in modules.items():
            a, b = self.a[target], self.b[target]
            torch.index_select(module.lora_a[:, :r], 0, self.slots, out=a.view(w, r, -1))
            b.view(b.shape[0], w, r).copy_(
                module.lora_b[:, :, :r].index_select(0, self.slots).transpose(0, 1))
            torch.index_select(module.scaling, 0, self.slots, out=self.block_scale[target])
            self.scale[target].copy_(self.block_scale[target].repeat_interleave(r))
            torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0, out=a)
            torch.nan_to_num(b, nan=0.0, posinf=0.0, neginf=0.0, out=b)
        self.poison.zero_()

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """`t` [rows, width * r] with each row's other blocks zero."""
        return torch.where(self.mask[:t.shape[0]], t, 0.0)

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """A stored rank-r shrink [rows, r] as the rank-wide one: each row's values in its
        job's block."""
        return self.keep(s.repeat(1, self.width))

    def own_block(self, t: torch.Tensor) -> torch.Tensor:
        """`t` [rows, width * r] as each row's own block [rows, r] (the others dropped exactly)."""
        return self.keep(t).view(t.shape[0], self.width, self.rank).sum(dim=1)

    def blocks_a(self, target: str) -> torch.Tensor:
        """The staged A's as the kernels' slots: [width, r, in]."""
        return self.a[target].view(self.width, self.rank, -1)

    def blocks_b(self, target: str) -> torch.Tensor:
        """The staged B's as the kernels' slots: [width, out, r] (a view of B_cat)."""
        b = self.b[target]
        return b.view(b.shape[0], self.width, self.rank).transpose(0, 1)

    def kernel_meta(self, rows: int) -> LoRAKernelMeta:
        """The fused LoRA kernels' routing of a window of `rows` (padded) rows: one segment per job's
        rows in row order (empty ones past them), rows of no block in none. Its tensors are the ones
        `load` rewrites, so a captured graph routes every window it replays; the kernels' grids
        take `rows` as the longest segment."""
        return LoRAKernelMeta(token_slots=self.token_blocks[:rows], seg_starts=self.segments[0],
                              seg_lens=self.segments[1], seg_slots=self.segments[2], num_tokens=rows,
                              max_seg_len=rows, decode_only=False, slots=None)

    def add_grad_b(self, target: str, grad: torch.Tensor) -> None:
        """Add dB [out, width * r] into the per-job blocks."""
        blocks = self.grad_b_blocks[target]
        blocks.add_(grad.view(grad.shape[0], self.width, self.rank).transpose(0, 1))

    def mark_nonfinite(self, rows: torch.Tensor) -> torch.Tensor:
        """Mark every job with a non-finite value in its rows of `rows` [n, ...]; returns which
        rows have one ([n] bool)."""
        bad = ~torch.isfinite(rows).all(dim=1)  # [n]
        hit = (self.row_block[:rows.shape[0], None] == self._blocks) & bad[:, None]  # [n, width]
        self.poison.add_(torch.where(hit.any(dim=0), float("nan"), 0.0))
        return bad

    def admit(self, rows: torch.Tensor, index: torch.Tensor | None = None,
              dump_row: int = 0) -> None:
        """Gradient rows entering the window (in place): a row with a non-finite value marks
        its job and becomes zero, and its entry of the activations' gather `index` reads
        `dump_row` instead."""
        bad = self.mark_nonfinite(rows)
        rows.masked_fill_(bad[:, None], 0.0)
        if index is not None:
            index.masked_fill_(bad, dump_row)

    def seal(self) -> None:
        """The marks into the gradient blocks (a marked job's dA gets a NaN), at the end of
        the last piece."""
        first = next(iter(self.grad_a.values()))
        first.view(self.width, self.rank, -1)[:, 0, 0].add_(self.poison)

    # ----------------------------------------------------------------- around the pieces
    def load(self, slots: list[int], blocks: list[tuple[int, int]], bucket: int) -> None:
        """The jobs' LoRA `slots` (block i: slots[i]; spare blocks repeat the first) and the
        window's rows by job: (block, number of rows) in row order, each block's rows
        contiguous, padded to `bucket` rows (padding rows belong to no block)."""
        row_block = torch.full((bucket,), -1, dtype=torch.long)
        runs: list[list[int]] = []  # [first row, rows, block] in row order
        offset = 0
        for block, n in blocks:
            if runs and runs[-1][2] == block:
                runs[-1][1] += n
            elif any(run[2] == block for run in runs):
                raise ValueError(f"the rows of block {block} are not contiguous")
            else:
                runs.append([offset, n, block])
            row_block[offset:offset + n] = block
            offset += n
        # spare segments: no rows, starting past every row (the starts stay sorted)
        runs += [[bucket, 0, 0]] * (self.width - len(runs))
        self.slots.copy_(torch.tensor(slots + slots[:1] * (self.width - len(slots))))
        self.row_block[:bucket].copy_(row_block)
        self.segments.copy_(torch.tensor(runs, dtype=torch.int32).T)
        self.token_blocks[:bucket].copy_(self.row_block[:bucket])
        torch.eq(self.row_block[:bucket, None], self._block_of_col, out=self.mask[:bucket])

    def unstage(self, grads: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Add block i's gradients into grads[i] (target -> (dA, dB) of that job's layer; a
        marked job's with a NaN) and zero the staged gradients."""
        r, own, staged = self.rank, [], []
        for i, parts in enumerate(grads):
            for target, (grad_a, grad_b) in parts.items():
                own += [grad_a, grad_b]
                staged += [self.grad_a[target][i * r:(i + 1) * r], self.grad_b_blocks[target][i]]
        torch._foreach_add_(own, staged)
        torch._foreach_zero_([*self.grad_a.values(), *self.grad_b_blocks.values()])

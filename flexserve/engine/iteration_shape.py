"""What the latency model sees of an iteration: counts of tokens, rows, windows and query-key
pairs (`IterationShape`), and the shapes of a plan and of its parts."""

from __future__ import annotations

from dataclasses import dataclass, fields

from flexserve.engine.plan import BatchPlan


@dataclass(slots=True)
class IterationShape:
    """The work of one iteration as the latency model sees it (counts only)."""

    prefill_tokens: int = 0  # inference tokens in rows with more than one new token
    prefill_attention: int = 0  # over those rows: n * (num_computed + (n + 1) / 2) query-key pairs
    decode_rows: int = 0  # inference rows with exactly one new token
    decode_context: int = 0  # over decode rows: num_computed + 1 (keys each reads)
    finetune_tokens: int = 0  # tokens of fine-tuning forward windows
    finetune_attention: int = 0  # query-key pairs of those windows (num_computed = start)
    backward_tokens: int = 0  # over backward windows: end - start (token-layers)
    backward_attention: int = 0  # over backward windows: (end - start) * (start + end + 1) / 2
    # Beyond the counts above: fixed costs per window (a backward window runs one layer's op
    # sequence once; a forward window has its own loss, LoRA segment and activation stores).
    backward_windows: int = 0  # backward windows
    finetune_windows: int = 0  # fine-tuning forward windows

    def __add__(self, other: IterationShape) -> IterationShape:
        return IterationShape(*[getattr(self, name) + getattr(other, name)
                                for name in SHAPE_FIELDS])

    @property
    def total_forward_tokens(self) -> int:
        return self.prefill_tokens + self.decode_rows + self.finetune_tokens


SHAPE_FIELDS = tuple(f.name for f in fields(IterationShape))


def _pairs(num_computed: int, num_new: int) -> int:
    """Causal query-key pairs of n queries after c cached keys: n * (c + (n + 1) / 2)."""
    return num_new * num_computed + num_new * (num_new + 1) // 2


def inference_row_shape(num_computed: int, num_new: int) -> IterationShape:
    """One inference row: a decode row (one new token) or a prefill chunk."""
    if num_new <= 0:
        return IterationShape()
    if num_new == 1:
        return IterationShape(decode_rows=1, decode_context=num_computed + 1)
    return IterationShape(prefill_tokens=num_new, prefill_attention=_pairs(num_computed, num_new))


def forward_window_shape(start: int, num_tokens: int) -> IterationShape:
    """A fine-tuning forward window of `num_tokens` at position `start` (finetune fields only)."""
    if num_tokens <= 0:
        return IterationShape()
    return IterationShape(finetune_tokens=num_tokens,
                          finetune_attention=_pairs(start, num_tokens), finetune_windows=1)


def backward_window_shape(start: int, end: int) -> IterationShape:
    """One layer's backward over [start, end), keys [0, end) (backward fields only)."""
    if end <= start:
        return IterationShape()
    return IterationShape(backward_tokens=end - start,
                          backward_attention=_pairs(start, end - start), backward_windows=1)


def plan_shape(plan: BatchPlan) -> IterationShape:
    """The counts of everything a plan runs (optimizer steps are not modelled): the sum of its
    rows' and windows' shapes, counted in place (a step of hundreds of rows builds no shape per
    row)."""
    prefill_tokens = prefill_attention = decode_rows = decode_context = 0
    for row in plan.sequences:
        n = row.num_scheduled_tokens
        if n == 1:
            decode_rows += 1
            decode_context += row.num_computed_tokens + 1
        elif n > 1:
            prefill_tokens += n
            prefill_attention += _pairs(row.num_computed_tokens, n)
    finetune_tokens = finetune_attention = finetune_windows = 0
    for window in plan.finetune_windows:
        n = window.end - window.start
        if n > 0:
            finetune_tokens += n
            finetune_attention += _pairs(window.start, n)
            finetune_windows += 1
    backward_tokens = backward_attention = backward_windows = 0
    for window in plan.backward_windows:
        n = window.end - window.start
        if n > 0:
            backward_tokens += n
            backward_attention += _pairs(window.start, n)
            backward_windows += 1
    return IterationShape(prefill_tokens, prefill_attention, decode_rows, decode_context,
                          finetune_tokens, finetune_attention, backward_tokens,
                          backward_attention, backward_windows, finetune_windows)

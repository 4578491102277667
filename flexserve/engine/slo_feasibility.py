"""Whether the device can meet the TPOT SLO at all: a decode step alone against the TPOT limit.

Fine-tuning only takes what the SLO leaves, so an SLO below what a decode step costs leaves it
nothing beside running requests, and no request meets the SLO whatever the scheduler does. The
operator must hear that, not discover it from a 0% attainment: `TPOTFeasibility` judges it at
start-up from the latency profile (one decode row at batch 1) and online from the measured time
of decode-only iterations (an EWMA), logs a warning when the limit is out of reach and a note when
it is back within reach, and `feasible` feeds the `flexserve:slo_feasible{slo="tpot"}` gauge.
Pure Python, no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flexserve.engine.iteration_shape import IterationShape

logger = logging.getLogger(__name__)

DECODE_EWMA_ALPHA = 0.1  # weight of one decode-only iteration in the measured average
MIN_DECODE_SAMPLES = 8  # decode-only iterations measured before the online verdict
STARTUP_DECODE_CONTEXT = 128  # keys the start-up check's one decode row reads


class TPOTFeasibility:
    """Tracks whether a decode step fits the TPOT limit (`slo_tpot_ms` x (1 - `slo_margin`))."""

    def __init__(self, slo_tpot_ms: float, slo_margin: float) -> None:
        self.slo_tpot_ms = slo_tpot_ms
        self.limit_s = slo_tpot_ms / 1000.0 * (1.0 - slo_margin)
        self.feasible: bool | None = None  # None until a profile or measurements tell
        self.decode_step_s: float | None = None  # EWMA of measured decode-only iterations
        self.num_decode_samples = 0

    def check_profile(self, predict: Callable[[IterationShape], float]) -> None:
        """Start-up verdict from the latency profile: one decode row at batch 1."""
        shape = IterationShape(decode_rows=1, decode_context=STARTUP_DECODE_CONTEXT)
        self._judge(predict(shape), "the latency profile predicts a decode step of one request "
                                    "at batch 1")

    def observe(self, shape: IterationShape, seconds: float) -> None:
        """A measured iteration; only decode-only ones (no prefill, no fine-tuning) count."""
        if not is_decode_only(shape) or not 0.0 <= seconds < float("inf"):
            return
        self.num_decode_samples += 1
        if self.decode_step_s is None:
            self.decode_step_s = seconds
        else:
            self.decode_step_s += DECODE_EWMA_ALPHA * (seconds - self.decode_step_s)
        if self.num_decode_samples >= MIN_DECODE_SAMPLES:
            self._judge(self.decode_step_s,
                        f"decode-only iterations take on average (last batch: {shape.decode_rows} "
                        f"request(s))")

    def _judge(self, step_s: float, what: str) -> None:
        feasible = step_s <= self.limit_s
        if feasible == self.feasible:
            return
        was_known = self.feasible is not None
        self.feasible = feasible
        if not feasible:
            logger.warning(
                "TPOT SLO out of reach: %s %.1f ms, over the limit of %.1f ms (--slo-tpot-ms %g "
                "less --slo-margin). No request can meet the SLO on this device; fine-tuning "
                "runs beside requests only with --finetune-min-share > 0 and otherwise waits "
                "for idle iterations. Raise --slo-tpot-ms to what the device can do.",
                what, step_s * 1000.0, self.limit_s * 1000.0, self.slo_tpot_ms)
        elif was_known:
            logger.info("TPOT SLO within reach again: %s %.1f ms, under the limit of %.1f ms",
                        what, step_s * 1000.0, self.limit_s * 1000.0)


def is_decode_only(shape: IterationShape) -> bool:
    """Inference decode rows and nothing else."""
    return shape.decode_rows > 0 and not (
        shape.prefill_tokens or shape.finetune_tokens or shape.backward_tokens
        or shape.finetune_windows or shape.backward_windows)

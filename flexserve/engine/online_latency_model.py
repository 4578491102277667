"""The latency model the scheduler holds: a profile (or a conservative fallback) corrected online
by the iterations it measures."""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import fields
from operator import attrgetter

from flexserve.engine.iteration_shape import IterationShape
from flexserve.engine.latency_model import LatencyModel

logger = logging.getLogger(__name__)

# An iteration shape's counts as a tuple (`dataclasses.astuple` deep-copies each field: most of
# a refit's host time over 512 samples)
_shape_key = attrgetter(*(f.name for f in fields(IterationShape)))


class OnlineLatencyModel:
    """What the scheduler holds: a base model (a profile, or the fallback) corrected online.

    With a profile, predict = scale * forward + backward_scale * backward, where (forward,
    backward) is the base prediction split into the forward's share and the backward windows'
    (`LatencyModel.predict_parts`): one correction for each, as a profile can miss one kind of
    work alone (a profile whose backward windows were short under-predicts an iteration of many
    long ones, whose attention reads up to 8K keys each). Each observed iteration moves each
    scale towards the value that would have made its prediction exact, by `ewma_alpha` times
    that part's share (`_correct`); an iteration without backward windows moves `scale` exactly
    as an EWMA of measured / predicted. The measured time is clamped to [1/2, 2] x the
    prediction first, and each scale stays in [1/4, 4]. An iteration over `stall_ratio` (3) x the corrected
    prediction is a stall (a compile, an allocator retry) and leaves the scales alone, unless
    `max_stalls` (8) come in a row: then the device really is slower and the scales follow.

    Without a profile (`is_fallback`) the model is conservative on purpose: an optimistic f breaks
    the inference SLO, a pessimistic one only costs fine-tuning throughput.
    - Fine-tuning work is capped: a shape with more fine-tuning forward tokens or backward
      token-layers than max(initial_window, 2 x the most in one observed iteration of the data of
      the current fit) is predicted to take forever (inf). Windows so grow at most 2x per refit
      and never extrapolate far beyond measured shapes.
    - Until `min_fit_samples` distinct shapes have been observed there is no fit and no growth:
      the prediction for a shape within the cap is `safety_factor` x the longest of the last 16
      measured iterations (0 before the first; the cap alone bounds that first window).
    - Then every `refit_interval` observations the model is refitted by NNLS (like a profile) on
      the last `max_samples` observations, and predict = fit x scale x safety_factor (after each
      refit the scale starts at the median of measured / fitted over the last 16 iterations,
      what the new fit still misses on the newest work, and tracks drift between refits; the fit
      itself separates backward work, so the fallback has one scale). A due refit runs when
      the fit is next used for fine-tuning work (a prediction with fine-tuning tokens, `model`,
      the caps), not in `observe`: inference-only serving never pays for it (a refit on 512
      samples took ~16 ms of host time, ~0.5 ms per decode step on average, measured on this
      project's CPU with `benchmarks/host_overhead.py --profile`).
    """

    def __init__(self, base: LatencyModel | None, ewma_alpha: float = 0.1, *,
                 safety_factor: float = 1.25, initial_window: int = 16, min_fit_samples: int = 8,
                 refit_interval: int = 16, max_samples: int = 512,
                 error_window: int = 100) -> None:
        if not 0.0 < ewma_alpha <= 1.0:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {ewma_alpha}")
        if safety_factor < 1.0:
            raise ValueError(f"safety_factor must be >= 1, got {safety_factor}")
        self.base = base
        self.ewma_alpha = ewma_alpha
        self.safety_factor = safety_factor
        self.initial_window = initial_window
        self.min_fit_samples = min_fit_samples
        self.refit_interval = refit_interval
        self._scale = 1.0
        self._backward_scale = 1.0  # with a profile: the backward windows' own correction
        self._num_observed = 0
        self.stall_ratio = 3.0  # measured / predicted above which an iteration is a stall
        self.max_stalls = 8  # stalls in a row after which the scale follows anyway
        self._num_stalls = 0
        self._errors: deque[float] = deque(maxlen=error_window)
        # Fallback state: observations, the current fit and the caps its data allows.
        self._samples: deque[tuple[IterationShape, float]] = deque(maxlen=max_samples)
        self._recent: deque[float] = deque(maxlen=16)
        self._fitted: LatencyModel | None = None
        self._since_fit = 0
        self._refit_due = False
        self._max_finetune_tokens = initial_window
        self._max_backward_tokens = initial_window

    @property
    def is_fallback(self) -> bool:
        """True when no profile was loaded."""
        return self.base is None

    @property
    def scale(self) -> float:
        """The current correction factor of the base (or fallback fit) prediction."""
        return self._scale

    @property
    def backward_scale(self) -> float:
        """The correction factor of the profile's backward-window terms (1 without a profile)."""
        return self._backward_scale

    @property
    def num_observed(self) -> int:
        return self._num_observed

    @property
    def error_ratio(self) -> float:
        """Rolling mean of |predicted - measured| / measured (0 before any sample)."""
        return sum(self._errors) / len(self._errors) if self._errors else 0.0

    @property
    def model(self) -> LatencyModel | None:
        """The profile, else the fallback's current fit (None before its first)."""
        if self.base is not None:
            return self.base
        self._refit_if_due()
        return self._fitted

    @property
    def max_finetune_tokens(self) -> int | None:
        """The fallback's cap on fine-tuning forward tokens per iteration (None with a profile)."""
        if self.base is not None:
            return None
        self._refit_if_due()
        return self._max_finetune_tokens

    @property
    def max_backward_tokens(self) -> int | None:
        """The fallback's cap on backward token-layers per iteration (None with a profile)."""
        if self.base is not None:
            return None
        self._refit_if_due()
        return self._max_backward_tokens

    def predict(self, shape: IterationShape) -> float:
        """Seconds the iteration is expected to take (corrected); inf when the fallback refuses
        to extrapolate that far."""
        if self.base is not None:
            forward, backward = self.base.predict_parts(shape)
            return self._scale * forward + self._backward_scale * backward
        if shape.finetune_tokens or shape.backward_tokens:
            self._refit_if_due()
        if (shape.finetune_tokens > self._max_finetune_tokens
                or shape.backward_tokens > self._max_backward_tokens):
            return math.inf
        if self._fitted is None:
            return self.safety_factor * max(self._recent, default=0.0)
        return self._fitted.predict(shape) * self._scale * self.safety_factor

    def observe(self, shape: IterationShape, seconds: float) -> None:
        """Record one executed iteration (call after every step); ignores non-positive times."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        if self.base is not None:
            forward, backward = self.base.predict_parts(shape)
            predicted = self._scale * forward + self._backward_scale * backward
        else:  # the fallback's fit has one scale (it is refitted on what it sees)
            predicted = self.predict(shape)  # (refits when due)
            forward, backward = (self._fitted.predict(shape) if self._fitted else 0.0), 0.0
        if math.isfinite(predicted) and predicted > 0:
            self._errors.append(abs(predicted - seconds) / seconds)
        self._num_observed += 1
        corrected = self._scale * forward + self._backward_scale * backward
        if corrected > 0:
            # A lone iteration several times slower than predicted is a stall (a kernel compiled
            # for a new shape, an allocator retry), not a slower device: H200, Llama-3.1-8B, the
            # first backward windows of a job took 1.0-1.3 s against 45 ms predicted and drove
            # the scale to 3.5, shrinking every window for the next ~20 iterations. Only a run of
            # `max_stalls` such iterations in a row moves the scales.
            stall = seconds > self.stall_ratio * corrected
            self._num_stalls = self._num_stalls + 1 if stall else 0
            if not 0 < self._num_stalls <= self.max_stalls:
                self._correct(forward, backward, corrected, seconds)
        if self.base is None:
            self._samples.append((shape, seconds))
            self._recent.append(seconds)
            self._since_fit += 1
            if self._since_fit >= self.refit_interval or self._fitted is None:
                self._refit_due = True

    def _correct(self, forward: float, backward: float, corrected: float,
                 seconds: float) -> None:
        """Move (scale, backward_scale) towards `seconds` (clamped to [1/2, 2] x `corrected`):
        each towards the value that would have made the prediction exact with the other one
        kept (clamped to [1/2, 2] x itself), by `ewma_alpha` times its part's share of the
        prediction. An iteration without backward windows moves `scale` as an EWMA of measured
        / predicted; one that is mostly backward windows moves mostly `backward_scale`."""
        target = min(max(seconds, 0.5 * corrected), 2.0 * corrected)
        scale, backward_scale = self._scale, self._backward_scale
        share = backward_scale * backward / corrected  # the backward windows' share
        if forward > 0:
            implied = min(max((target - backward_scale * backward) / forward, 0.5 * scale),
                          2.0 * scale)
            self._scale = min(max(scale + self.ewma_alpha * (1 - share) * (implied - scale),
                                  0.25), 4.0)
        if backward > 0:
            implied = min(max((target - scale * forward) / backward, 0.5 * backward_scale),
                          2.0 * backward_scale)
            self._backward_scale = min(max(
                backward_scale + self.ewma_alpha * share * (implied - backward_scale), 0.25), 4.0)

    def _refit_if_due(self) -> None:
        if self._refit_due:
            self._refit_due = False
            self._refit()

    def _refit(self) -> None:
        distinct = {_shape_key(shape) for shape, _ in self._samples}
        if len(distinct) < self.min_fit_samples:
            return
        samples = list(self._samples)
        first = self._fitted is None
        self._fitted = LatencyModel.fit(samples, {"source": "online fallback"})
        self._since_fit = 0
        # What the fit still misses on the newest iterations (a fit over 512 mostly older,
        # smaller ones can under-predict the windows that just grew): kept, not forgotten.
        ratios = [seconds / predicted for shape, seconds in samples[-16:]
                  if (predicted := self._fitted.predict(shape)) > 0]
        self._scale = min(max(statistics.median(ratios), 0.25), 4.0) if ratios else 1.0
        self._max_finetune_tokens = max(
            self.initial_window, 2 * max(s.finetune_tokens for s, _ in samples))
        self._max_backward_tokens = max(
            self.initial_window, 2 * max(s.backward_tokens for s, _ in samples))
        if first:
            logger.info("latency model (fallback, no profile): first fit on %d iterations; "
                        "fine-tuning windows now grow at most 2x per %d iterations (run "
                        "`flexserve profile` to size them right away)", len(samples),
                        self.refit_interval)

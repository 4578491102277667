"""The latency model of the hybrid token scheduler (FlexLLM 6.2): f(iteration) -> seconds.

After the scheduler has chosen an iteration's inference rows (work c), it adds the largest
fine-tuning window s with f(c + s) <= TPOT SLO - margin (`max_window`), then backward work the
same way. f sees an iteration only through the counts of `IterationShape`.

Model (fitted per device, model and dtype by `flexserve profile`; `docs/latency_model.md`):

    f = c0 + c1*[T > 0] + c2*[prefill_tokens + finetune_tokens > 0]
        + c3*T + sum_k h_k*max(0, T - knot_k)
        + c4*decode_rows + c5*decode_context + c6*(prefill_attention + finetune_attention)
        + c7*finetune_windows + c8*finetune_tokens
        + c9*backward_windows + c10*backward_tokens + c11*backward_attention

T = total forward tokens. [T > 0] is the fixed cost of running the model at all (reading every
weight once: a decode step at batch 1); the second indicator is the extra fixed cost of an
iteration that is not decode-only (a mixed-iteration graph instead of a decode one; on the CPU,
the prefill attention masks). The hinges at powers of two (up to the largest T profiled) bend the token cost upwards
where the GEMMs turn from memory bound to compute bound. decode_rows is per-row sampling,
decode_context the KV every decode row reads, the attention term counts query-key pairs. A
fine-tuning forward window pays its loss, LoRA segment and activation-store setup (c7) and per
token its loss over the vocabulary and its stores (c8); a backward window pays one layer's op
sequence (c9) plus per token-layer (c10) and per query-key pair (c11) costs. All coefficients are
fitted by non-negative least squares (our own Lawson-Hanson; numpy is imported inside the fit
only) on relative error (rows weighted by 1 / measured), so f is monotone non-decreasing in every
count and convex in T, which `max_window`'s binary search needs. Optimizer steps are not
modelled (one per mini-batch, a small share of the AdamW-over-adapters time of an iteration).

`IterationShape` (iteration_shape.py) is what f reads; `OnlineLatencyModel`
(online_latency_model.py) is what the scheduler holds: a profile corrected by an EWMA of measured /
predicted, or, without a profile, a conservative fallback that learns from the iterations it sees.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from flexserve.engine.iteration_shape import IterationShape

logger = logging.getLogger(__name__)

FORMAT = "flexserve-latency-model"
FORMAT_VERSION = 1


def max_window(cost: Callable[[int], float], limit: float, max_tokens: int) -> int:
    """Largest s in [0, max_tokens] with cost(s) <= limit, for cost monotone non-decreasing in s
    (binary search, at most 2 + log2(max_tokens) calls); 0 when cost(1) > limit."""
    if max_tokens <= 0 or not cost(1) <= limit:
        return 0
    if cost(max_tokens) <= limit:
        return max_tokens
    fits, too_big = 1, max_tokens  # cost(fits) <= limit < cost(too_big)
    while too_big - fits > 1:
        mid = (fits + too_big) // 2
        if cost(mid) <= limit:
            fits = mid
        else:
            too_big = mid
    return fits


# ---------------------------------------------------------------------------------- the model
_TERMS: tuple[tuple[str, Callable[[IterationShape], float]], ...] = (
    ("decode_rows", lambda s: s.decode_rows),
    ("decode_context", lambda s: s.decode_context),
    ("attention", lambda s: s.prefill_attention + s.finetune_attention),
    ("finetune_windows", lambda s: s.finetune_windows),
    ("finetune_tokens", lambda s: s.finetune_tokens),
    ("backward_windows", lambda s: s.backward_windows),
    ("backward_tokens", lambda s: s.backward_tokens),
    ("backward_attention", lambda s: s.backward_attention),
)
_BACKWARD_TERMS = ("backward_windows", "backward_tokens", "backward_attention")
_MIN_KNOT = 16


def default_knots(max_forward_tokens: int) -> list[int]:
    """Hinge knots of T: powers of two from 16 up to below the largest T the data holds (a knot
    beyond the data could only be fitted to nothing)."""
    knots, knot = [], _MIN_KNOT
    while knot < max_forward_tokens:
        knots.append(knot)
        knot *= 2
    return knots


def _features(shape: IterationShape, knots: Sequence[int]) -> list[float]:
    t = shape.total_forward_tokens
    eager = shape.prefill_tokens + shape.finetune_tokens > 0
    row = [1.0, 1.0 if t > 0 else 0.0, 1.0 if eager else 0.0, float(t)]
    row.extend(float(max(0, t - k)) for k in knots)
    row.extend(float(fn(shape)) for _, fn in _TERMS)
    return row


def _feature_names(knots: Sequence[int]) -> list[str]:
    return (["intercept", "forward", "eager", "forward_tokens"]
            + [f"forward_tokens_over_{k}" for k in knots] + [name for name, _ in _TERMS])


def nnls(a: Any, b: Any, max_iter: int | None = None) -> Any:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson, 1974); numpy arrays."""
    import numpy as np

    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.abs(a).sum(axis=0).max() * max(m, n)
    max_iter = 3 * n if max_iter is None else max_iter
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or w[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if s[passive].min() > 0:
                break
            # Step back to where the first passive variable hits zero, and drop it.
            blocking = passive & (s <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - s[blocking]))
            x = x + alpha * (s - x)
            passive &= x > tol
        x = s
        w = a.T @ (b - a @ x)
    return x


def relative_errors(model: Any, samples: Sequence[tuple[IterationShape, float]]) -> dict:
    """Median, p90 and max of |predicted - measured| / measured over the samples."""
    errors = sorted(abs(model.predict(shape) - seconds) / seconds
                    for shape, seconds in samples if seconds > 0)
    if not errors:
        return {"median_rel_error": 0.0, "p90_rel_error": 0.0, "max_rel_error": 0.0,
                "num_samples": 0}
    p90 = errors[min(len(errors) - 1, math.ceil(0.9 * len(errors)) - 1)]
    return {"median_rel_error": statistics.median(errors), "p90_rel_error": p90,
            "max_rel_error": errors[-1], "num_samples": len(errors)}


class LatencyModel:
    """f(shape) -> seconds: the model of the module docstring, fitted by non-negative least
    squares, so f is monotone non-decreasing in every count (the window search needs that)."""

    def __init__(self, coefficients: Sequence[float], knots: Sequence[int],
                 metadata: dict | None = None) -> None:
        knots = [int(k) for k in knots]
        coefficients = [float(c) for c in coefficients]
        if len(coefficients) != len(_feature_names(knots)):
            raise ValueError(f"{len(coefficients)} coefficients for "
                             f"{len(_feature_names(knots))} features")
        if any(not math.isfinite(c) or c < 0 for c in coefficients):
            raise ValueError("latency model coefficients must be finite and >= 0")
        self.coefficients = coefficients
        self.knots = knots
        self._backward_terms = [name in _BACKWARD_TERMS for name in _feature_names(knots)]
        self.metadata: dict = dict(metadata or {})

    def predict(self, shape: IterationShape) -> float:
        return sum(c * f for c, f in zip(self.coefficients, _features(shape, self.knots)))

    def predict_parts(self, shape: IterationShape) -> tuple[float, float]:
        """`predict` split in two: (the forward's share, the backward windows' share: the
        c9-c11 terms); they sum to `predict(shape)`."""
        parts = [0.0, 0.0]
        for c, f, backward in zip(self.coefficients, _features(shape, self.knots),
                                  self._backward_terms):
            parts[backward] += c * f
        return parts[0], parts[1]

    @classmethod
    def fit(cls, samples: Sequence[tuple[IterationShape, float]], metadata: dict | None = None,
            knots: Sequence[int] | None = None) -> LatencyModel:
        """NNLS on relative error; `knots` default to `default_knots` of the data's largest T.
        ValueError without samples or with a time that is not positive."""
        import numpy as np

        if not samples:
            raise ValueError("no samples to fit the latency model to")
        if any(not (seconds > 0 and math.isfinite(seconds)) for _, seconds in samples):
            raise ValueError("every measured time must be a positive number of seconds")
        if knots is None:
            knots = default_knots(max(s.total_forward_tokens for s, _ in samples))
        x = np.array([_features(shape, knots) for shape, _ in samples])
        y = np.array([seconds for _, seconds in samples])
        # Columns scaled to a max of 1 (conditioning); rows by 1 / y (relative error).
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        coef = nnls(x / scale / y[:, None], np.ones(len(y))) / scale
        model = cls(np.maximum(coef, 0.0).tolist(), knots, metadata)
        model.metadata.setdefault("created", time.time())
        model.metadata["fit"] = model.evaluate(samples)
        return model

    def evaluate(self, samples: Sequence[tuple[IterationShape, float]]) -> dict:
        """{"median_rel_error", "p90_rel_error", "max_rel_error", "num_samples"}."""
        return relative_errors(self, samples)

    def coefficient_dict(self) -> dict[str, float]:
        """Feature name -> coefficient (seconds per unit of the feature)."""
        return dict(zip(_feature_names(self.knots), self.coefficients))

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": FORMAT_VERSION, "knots": list(self.knots),
                "coefficients": self.coefficient_dict(), "metadata": self.metadata}

    @classmethod
    def from_dict(cls, data: dict) -> LatencyModel:
        """ValueError for anything but a profile this version wrote."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} document")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"latency model version {data.get('version')!r}; this flexserve "
                             f"reads version {FORMAT_VERSION}")
        knots, named = data.get("knots"), data.get("coefficients")
        if not isinstance(knots, list) or not isinstance(named, dict):
            raise ValueError("a latency model needs a knots list and a coefficients object")
        names = _feature_names(knots)
        if sorted(named) != sorted(names):
            raise ValueError(f"latency model coefficients {sorted(named)} do not match the "
                             f"features {names}")
        return cls([named[n] for n in names], knots, data.get("metadata") or {})

    def save(self, path: str) -> None:
        """Write JSON atomically (a temporary file in the same directory, then os.replace)."""
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".json", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=2, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str) -> LatencyModel:
        """ValueError when the file is not valid JSON of a latency model."""
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not JSON: {e}") from e
        return cls.from_dict(data)


# ------------------------------------------------------------------------------ profile files
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.").lower() or "none"


def profile_path(state_dir: str, device_name: str, model_name: str, dtype: str,
                 tensor_parallel_size: int = 1) -> str:
    """<state_dir>/profiles/<device>__<model>__<dtype>.json (<...>__tp<N>.json for N
    tensor-parallel ranks), each part sanitized ([A-Za-z0-9._-], so a model directory's slashes
    become dashes)."""
    name = "__".join(_slug(part) for part in (device_name, model_name, dtype))
    if tensor_parallel_size > 1:
        name += f"__tp{tensor_parallel_size}"
    return os.path.join(state_dir, "profiles", f"{name}.json")


def load_matching_profile(state_dir: str, device_name: str, model_name: str,
                          dtype: str, tensor_parallel_size: int = 1) -> LatencyModel | None:
    """The profile `flexserve profile` saved for this device, model, dtype and number of
    tensor-parallel ranks, or None (also, with a warning, when the file is unreadable or was
    made for something else)."""
    path = profile_path(state_dir, device_name, model_name, dtype, tensor_parallel_size)
    if not os.path.exists(path):
        return None
    try:
        model = LatencyModel.load(path)
    except (OSError, ValueError) as e:
        logger.warning("ignoring latency profile %s: %s", path, e)
        return None
    meta = {"tensor_parallel_size": 1, **model.metadata}
    expected = {"device_name": device_name, "model": model_name, "dtype": dtype,
                "tensor_parallel_size": tensor_parallel_size}
    wrong = {k: meta.get(k) for k, v in expected.items() if meta.get(k) != v}
    if wrong:
        logger.warning("ignoring latency profile %s: made for %s, not %s", path, wrong, expected)
        return None
    return model

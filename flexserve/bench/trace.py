"""Arrival traces for `flexserve bench serve --trace`: time-varying load (FlexLLM figure 12).

A trace is a JSONL or CSV file with one request per line or row: its arrival time and,
optionally, its prompt and output lengths. Column names follow the common public traces:

- arrival: `timestamp`, `arrival_time`, `arrival` or `time` (seconds, any origin), or the Azure
  LLM inference trace's `TIMESTAMP` (a date-time string);
- prompt tokens: `input_len`, `prompt_len`, `input_tokens`, `prompt_tokens` or `ContextTokens`;
- output tokens: `output_len`, `output_tokens` or `GeneratedTokens`.

Arrivals are shifted so the first is at 0 and sorted. Requests without lengths take them from the
benchmark's dataset. `bursty_trace` makes the synthetic trace the co-serving benchmark ships (a
rate ramping up and down), and `timeline` bins a run's requests and fine-tuning samples by time.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from datetime import datetime
from typing import Any

TIME_COLUMNS = ("timestamp", "arrival_time", "arrival", "time", "TIMESTAMP")
PROMPT_COLUMNS = ("input_len", "prompt_len", "input_tokens", "prompt_tokens", "ContextTokens")
OUTPUT_COLUMNS = ("output_len", "output_tokens", "GeneratedTokens")


@dataclass(slots=True, frozen=True)
class TraceEntry:
    """One request of a trace."""

    arrival_s: float  # seconds after the trace's first arrival
    prompt_len: int | None  # prompt tokens; None: the dataset's
    output_len: int | None  # output tokens (max_tokens); None: the dataset's


def load_trace(path: str) -> list[TraceEntry]:
    """The entries of a JSONL (`.jsonl`, `.json`) or CSV file, by arrival; ValueError naming the
    file and line of a bad entry, or an empty file."""
    rows = _read_rows(path)
    times, entries = [], []
    for where, row in rows:
        times.append(_arrival(row, where))
        entries.append((_length(row, PROMPT_COLUMNS, where), _length(row, OUTPUT_COLUMNS, where)))
    if not times:
        raise ValueError(f"{path} has no requests")
    first = min(times)
    order = sorted(range(len(times)), key=times.__getitem__)
    return [TraceEntry(times[i] - first, *entries[i]) for i in order]


def _read_rows(path: str) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        if path.endswith((".jsonl", ".json")):
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not JSON ({e})") from e
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: expected an object with an arrival time")
                rows.append((where, row))
        elif path.endswith(".csv"):
            for number, row in enumerate(csv.DictReader(f), 2):
                rows.append((f"{path} line {number}", row))
        else:
            raise ValueError(f"{path}: a trace is a .jsonl or .csv file")
    return rows


def _arrival(row: dict[str, Any], where: str) -> float:
    name = next((c for c in TIME_COLUMNS if c in row), None)
    if name is None:
        raise ValueError(f"{where}: no arrival time (one of {', '.join(TIME_COLUMNS)})")
    value = row[name]
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        try:
            seconds = datetime.fromisoformat(str(value).strip()).timestamp()
        except ValueError:
            raise ValueError(f"{where}: {name} {value!r} is neither seconds nor a date-time") \
                from None
    if not math.isfinite(seconds):
        raise ValueError(f"{where}: {name} must be finite, got {value!r}")
    return seconds


def _length(row: dict[str, Any], columns: tuple[str, ...], where: str) -> int | None:
    name = next((c for c in columns if c in row and row[c] not in (None, "")), None)
    if name is None:
        return None
    value = row[name]
    try:
        n = int(value) if not isinstance(value, float) or value.is_integer() else None
    except (TypeError, ValueError):
        n = None
    if n is None or isinstance(value, bool) or n < 1:
        raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    return n


def bursty_trace(duration_s: float, low_rate: float, high_rate: float, seed: int = 0
                 ) -> list[TraceEntry]:
    """Poisson arrivals whose rate ramps linearly from `low_rate` to `high_rate` over the first
    half of `duration_s` and back down over the second (thinning a `high_rate` process); no
    lengths (the dataset's)."""
    if not (duration_s > 0 and 0 < low_rate <= high_rate and math.isfinite(high_rate)):
        raise ValueError(f"a bursty trace needs duration > 0 and 0 < low <= high, got "
                         f"{duration_s}, {low_rate}, {high_rate}")
    rng = random.Random(f"bursty-{seed}")
    entries, t = [], 0.0
    while True:
        t += rng.expovariate(high_rate)
        if t >= duration_s:
            return entries
        ramp = 1.0 - abs(2.0 * t / duration_s - 1.0)  # 0 at the ends, 1 in the middle
        if rng.random() * high_rate <= low_rate + (high_rate - low_rate) * ramp:
            entries.append(TraceEntry(t, None, None))


def write_trace(path: str, entries: list[TraceEntry]) -> None:
    """JSONL with `arrival_time` and the lengths an entry has."""
    with open(path, "w", encoding="utf-8") as f:
        for e in entries:
            row: dict[str, Any] = {"arrival_time": round(e.arrival_s, 6)}
            if e.prompt_len is not None:
                row["input_len"] = e.prompt_len
            if e.output_len is not None:
                row["output_len"] = e.output_len
            f.write(json.dumps(row) + "\n")


def timeline(requests: list[dict[str, Any]], finetune_samples: list[dict[str, Any]] | None,
             bin_s: float, slo_tpot_ms: float | None) -> list[dict[str, Any]]:
    """Per `bin_s` seconds of the run (`requests`: `RequestRecord.to_dict()`s, binned by their
    scheduled send time): requests arrived (and their rate), their TPOT SLO
    attainment (successful requests with a TPOT; None without an SLO or such requests), and the
    fine-tuning forward tokens per second between the samples in the bin's span (`samples` of a
    `FinetuneMonitor` report, None without)."""
    if not bin_s > 0:
        raise ValueError(f"the timeline's bin must be > 0 s, got {bin_s}")
    end = max([r["scheduled_s"] for r in requests]
              + [s["t_s"] for s in finetune_samples or []] + [0.0])
    bins = []
    for i in range(int(end // bin_s) + 1):
        lo, hi = i * bin_s, (i + 1) * bin_s
        arrived = [r for r in requests if lo <= r["scheduled_s"] < hi]
        tpots = [r["tpot_s"] for r in arrived if r["error"] is None and r["tpot_s"] is not None]
        attainment = None
        if slo_tpot_ms is not None and tpots:
            attainment = sum(t * 1000.0 <= slo_tpot_ms for t in tpots) / len(tpots)
        bins.append({"t_s": lo, "requests": len(arrived), "request_rate": len(arrived) / bin_s,
                     "tpot_attainment": attainment,
                     "finetune_tokens_per_s": _finetune_rate(finetune_samples, lo, hi)})
    return bins


def _finetune_rate(samples: list[dict[str, Any]] | None, lo: float, hi: float) -> float | None:
    if not samples:
        return None
    inside = [s for s in samples if lo <= s["t_s"] <= hi and "forward" in s["metrics_tokens"]]
    if len(inside) < 2:
        return None
    first, last = inside[0], inside[-1]
    span = last["t_s"] - first["t_s"]
    if span <= 0:
        return None
    return (last["metrics_tokens"]["forward"] - first["metrics_tokens"]["forward"]) / span

"""What `flexserve bench serve` measured: per-request records and the run's statistics.

vLLM's `benchmark_serving` definitions: TTFT to the first chunk carrying text, TPOT = (e2e - ttft)
/ (output_tokens - 1), every inter-chunk gap (ITL) and E2E. Goodput is the completed requests per
second that meet every given SLO; the attainment of one SLO is the fraction of completed requests
meeting it. Plain functions; no server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """What the client measured for one request (times in seconds)."""

    index: int  # position in the send order
    tenant: str | None  # the `user` field it was sent with
    scheduled_s: float  # planned send time, from the benchmark start
    expected_prompt_len: int  # prompt tokens the dataset aimed for (0: unknown)
    max_tokens: int  # output tokens asked for
    sent_s: float = 0.0  # actual send time, from the benchmark start
    ttft_s: float | None = None  # to the first chunk carrying text
    # gaps between generated tokens: a text chunk's gap split evenly over the tokens it brings
    # (counted from per-chunk usage; one per chunk when the server reports none)
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None  # to the end of the stream
    prompt_tokens: int = 0  # from the usage chunk
    output_tokens: int = 0  # from the usage chunk, else the number of text chunks
    error: str | None = None  # why it failed; None when it completed

    @property
    def success(self) -> bool:
        return self.error is None and self.e2e_s is not None and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1); None for failed or one-token requests."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)  # type: ignore[operator]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std and each `p<q>` of `values`; None everywhere when there are none."""
    keys = ["mean", "median", "std", *(f"p{q:g}" for q in percentiles)]
    if not values:
        return dict.fromkeys(keys)
    mean = sum(values) / len(values)
    stats: dict[str, float | None] = {
        "mean": mean, "median": percentile(values, 50),
        "std": math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)),
    }
    stats.update({f"p{q:g}": percentile(values, q) for q in percentiles})
    return stats


def aggregate_metrics(records: Sequence[RequestRecord], duration_s: float,
                      percentiles: Sequence[float] = (50, 90, 99),
                      slo_ttft_ms: float | None = None,
                      slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """Totals, throughputs, latency statistics (ms), SLO attainment and goodput of a run.

    A one-token request has no TPOT (it is left out of the TPOT statistics) and meets any TPOT
    SLO, as in vLLM. Attainment is over completed requests; failed ones are counted apart.
    """
    done = [r for r in records if r.success]
    ms = lambda values: [v * 1000.0 for v in values]  # noqa: E731
    num_input = sum(r.prompt_tokens for r in done)
    num_output = sum(r.output_tokens for r in done)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    slos = {"ttft": slo_ttft_ms, "tpot": slo_tpot_ms}
    meets: dict[str, list[bool]] = {}
    for name, slo in slos.items():
        if slo is not None:
            value = (lambda r: r.ttft_s) if name == "ttft" else (lambda r: r.tpot_s or 0.0)
            meets[name] = [value(r) * 1000.0 <= slo for r in done]
    num_good = sum(all(ok) for ok in zip(*meets.values())) if meets else None
    return {
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(num_output),
        "total_token_throughput": per_s(num_input + num_output),
        "ttft_ms": summarize(ms(r.ttft_s for r in done), percentiles),
        "tpot_ms": summarize(ms(tpots), percentiles),
        "itl_ms": summarize(ms(g for r in done for g in r.itl_s), percentiles),
        "e2e_ms": summarize(ms(r.e2e_s for r in done), percentiles),
        "slo_ms": {k: v for k, v in slos.items() if v is not None},
        "slo_attainment": {k: (sum(v) / len(v) if v else None) for k, v in meets.items()},
        "goodput": None if num_good is None else per_s(num_good),
    }


def format_report(result: dict[str, Any]) -> str:
    """vLLM-style text table of a result (`benchmark`'s return value)."""
    m = result["metrics"]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any, fmt: str = ".2f") -> None:
        text = "n/a" if value is None else (format(value, fmt) if fmt else str(value))
        lines.append(f"{label:<40} {text:>9}")

    row("Successful requests:", m["num_completed"], "")
    row("Failed requests:", m["num_failed"], "")
    row("Benchmark duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"], "")
    row("Total generated tokens:", m["total_output_tokens"], "")
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for name, slo in m["slo_ms"].items():
        row(f"{name.upper()} SLO attainment (<= {slo:g} ms):",
            None if m["slo_attainment"][name] is None else 100 * m["slo_attainment"][name], ".1f")
    if m["goodput"] is not None:
        row("Request goodput (req/s):", m["goodput"])
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"),
                              ("e2e_ms", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for stat, value in m[key].items():
            if stat != "std":
                label = stat.capitalize() if stat in ("mean", "median") else stat.upper()
                row(f"{label} {short} (ms):", value)
    finetune = result.get("finetune")
    if finetune:
        lines.append("{s:{c}^50}".format(s="Fine-tuning", c="-"))
        row("Job:", finetune["job_id"], "")
        row("Status at the end:", finetune["status"], "")
        row("Trained tokens in the window:", finetune["trained_tokens"], "")
        row("Fine-tuning throughput (tok/s):", finetune["tokens_per_s"])
        if finetune.get("error"):
            lines.append(f"Job error: {finetune['error']}")
    if result["errors"]:
        lines.append("{s:{c}^50}".format(s="First errors", c="-"))
        lines.extend(result["errors"])
    lines.append("=" * 50)
    return "\n".join(lines)

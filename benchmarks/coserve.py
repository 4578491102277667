"""FlexLLM's co-serving comparison (NSDI'26 section 8.3, figure 11) against `flexserve serve`.

For each configuration it starts `flexserve serve` (random bf16 weights, LoRA slots of rank 16),
and for each arrival rate sends ShareGPT-like traffic with bursty gamma arrivals for --duration
seconds through `flexserve bench serve` (in this process) while a LoRA fine-tuning job (r=16 on
down_proj, sequences of --finetune-lengths random-word tokens) runs; it records TPOT/TTFT SLO
attainment, inference throughput and the job's trained tokens/s over the run window.

    python benchmarks/coserve.py                                  # the whole comparison, H200
    python benchmarks/coserve.py --policies coserve temporal-64   # a subset (appends lines)
    python benchmarks/coserve.py --plot-only RESULTS.jsonl --plot fig.svg
    python benchmarks/coserve.py --trace --policies coserve dynamic-temporal --plot trace.svg

With `--trace [FILE]` each policy replays an arrival trace once (FlexLLM figure 12's
time-varying load; by default the shipped bursty trace, 2 -> 20 -> 2 req/s over 90 s) and the
report is TPOT attainment and fine-tuning tokens/s per time bin, as a table and a plot.

Configurations: coserve, temporal-N (fixed interleaving: one fine-tuning iteration per N
inference iterations), dynamic-temporal, spatial, inference-only (no job) and finetune-only (the
job alone, no inference traffic, measured once on the coserve server). One server per
configuration serves all its rates; each rate gets a fresh job.

Time: the defaults (3 rates, 8 s of arrivals each, outputs capped at 256 tokens so the drain
after the arrivals stays short) are scaled down from FlexLLM's 20-minute traces to fit a 10-minute
run on one GPU: about 6 server starts plus 19 runs of ~15 s each. Results are appended line by
line to --out (docs/results/coserve-<gpu>-<date>.jsonl unless given) as each run ends, runs that
would pass --time-budget are skipped, and a comparison can be split over several runs with
--policies. A shipped architecture without a tokenizer (llama-3.1-8b) gets a generated
word-level tokenizer (one token per word) so text prompts and training files work.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402
from benchmarks.harness import gpu_slug  # noqa: E402,F401  (file names; tests use it from here)
from flexserve.bench.serve import parse_bench_serve_args, run_benchmark
from flexserve.bench.workload import PROMPT_WORDS, random_text

DEFAULT_POLICIES = ["coserve", "temporal-64", "temporal-128", "dynamic-temporal", "spatial",
                    "inference-only", "finetune-only"]
TEMPORAL_POLICIES = ("temporal-64", "temporal-128", "dynamic-temporal")
# The shipped synthetic trace: Poisson arrivals ramping 2 -> 20 -> 2 req/s over 90 s
# (`flexserve.bench.trace.bursty_trace(90, 2, 20, seed=0)`).
DEFAULT_TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traces",
                             "bursty-2-20-2.jsonl")
TARGET_TPOT_ATTAINMENT = 0.95
TARGET_FINETUNE_FRACTION = 0.76
# Two runs reach "equal attainment" when their TPOT attainments differ by at most this.
EQUAL_ATTAINMENT_TOLERANCE = 0.01


# ------------------------------------------------------------------------------ configurations
def server_policy_args(policy: str) -> list[str]:
    """`flexserve serve` options of one configuration; ValueError for an unknown name."""
    if policy in ("coserve", "finetune-only"):
        return ["--coserve-policy", "coserve"]
    if policy in ("dynamic-temporal", "spatial", "inference-only"):
        return ["--coserve-policy", policy]
    match = re.fullmatch(r"temporal-(\d+)", policy)
    if match and int(match.group(1)) > 0:
        return ["--coserve-policy", "temporal", "--temporal-frequency", match.group(1)]
    raise ValueError(f"unknown policy {policy!r}: expected coserve, temporal-N, dynamic-temporal,"
                     " spatial, inference-only or finetune-only")


def supported_server_flags() -> set[str]:
    """The long options `flexserve serve --help` lists (the server may predate some)."""
    text = subprocess.run([sys.executable, "-m", "flexserve.entrypoints.cli.main", "serve", "--help"],
                          capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", text))


# ------------------------------------------------------------------------------ inputs on disk
def write_word_tokenizer(model: str, directory: str) -> str | None:
    """A word-level tokenizer over the model's vocabulary (PROMPT_WORDS first, filler words
    after, its BOS/EOS at their ids, <unk> last) when the model ships none; None when it has
    its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from flexserve.model.registry import resolve_model

    resolved = resolve_model(model, load_format="dummy")
    if resolved.tokenizer_path is not None:
        return None
    config = resolved.hf_config
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    # Special tokens match inside words too, so none of them may be a word (nor the unknown
    # token: an unknown word stays one token).
    specials = {config.vocab_size - 1: "<unk>", config.bos_token_id: "<|begin_of_text|>",
                eos: "<|end_of_text|>"}
    vocab = {}
    for i in range(config.vocab_size):
        vocab[specials.get(i) or (PROMPT_WORDS[i] if i < len(PROMPT_WORDS) else f"<w{i}>")] = i
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=specials[config.bos_token_id],
                            eos_token=specials[eos], unk_token="<unk>").save_pretrained(directory)
    return directory


def write_finetune_file(path: str, num_sequences: int, min_len: int, max_len: int,
                        seed: int) -> None:
    """`{"text": ...}` lines of random words, lengths uniform in [min_len, max_len] tokens (one
    less word: the job appends EOS)."""
    rng = random.Random(f"coserve-finetune-{seed}")
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_sequences):
            f.write(json.dumps({"text": random_text(rng, rng.randint(min_len, max_len) - 1)}))
            f.write("\n")


# ------------------------------------------------------------------------------------ server
class ServerProcess:
    """`flexserve serve` as a subprocess; its log goes to a file."""

    def __init__(self, argv: list[str], port: int, log_path: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = open(log_path, "w", encoding="utf-8")
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until /health answered 200; RuntimeError with the log tail otherwise."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}):\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not healthy after {timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, num_lines: int = 30) -> str:
        self.log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-num_lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def warm_up(url: str) -> None:
    """One short request: first-call costs stay out of the first measurement."""
    response = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"],
        "prompt": " ".join(PROMPT_WORDS[:32]), "max_tokens": 8, "ignore_eos": True})
    response.raise_for_status()


# ------------------------------------------------------------------------------------ runs
def bench_argv(args: argparse.Namespace, url: str, policy: str, rate: float | None,
               finetune_file: str) -> list[str]:
    """`flexserve bench serve` options of one measurement."""
    argv = ["--base-url", url, "--endpoint", "completions", "--dataset-name", "sharegpt-like",
            "--max-model-len", str(args.max_model_len),
            "--sharegpt-max-output-len", str(args.max_output_len),
            "--slo-tpot-ms", str(args.slo_tpot_ms), "--slo-ttft-ms", str(args.slo_ttft_ms),
            "--seed", str(args.seed), "--disable-tqdm"]
    if args.trace:  # the trace's arrivals, until it ends
        argv += ["--trace", args.trace, "--trace-bin-s", str(args.trace_bin_s)]
    elif policy == "finetune-only":
        argv += ["--num-prompts", "0", "--duration", str(args.duration)]
    else:
        argv += ["--request-rate", str(rate), "--burstiness", str(args.burstiness),
                 "--duration", str(args.duration)]
    if policy != "inference-only":
        argv += ["--finetune-file", finetune_file, "--finetune-lora-r", "16",
                 "--finetune-target-modules", "down_proj",
                 "--finetune-max-seq-len", str(max(args.finetune_lengths)),
                 "--finetune-n-epochs", "100", "--finetune-batch-size", "1",
                 "--finetune-poll-interval", "0.5"]
    return argv


SERVER_SUMS = ("flexserve:iteration_latency_seconds", "flexserve:inter_token_latency_seconds")
SERVER_GAUGES = ("flexserve:latency_model_error_ratio", "flexserve:latency_model_scale",
                 "flexserve:latency_model_backward_scale", "flexserve:iteration_overhead_seconds")


def server_metrics(url: str) -> dict[str, float]:
    """The server's own view of a run: histogram sums and counts, and the scheduler's gauges."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10.0).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SERVER_GAUGES or sample.name.removesuffix("_sum") in SERVER_SUMS \
                    or sample.name.removesuffix("_count") in SERVER_SUMS:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def server_row(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Mean engine-step time and server-side inter-token latency over the run (ms), and the
    scheduler's gauges at its end: where TPOT goes, as the server saw it."""
    row: dict[str, Any] = {}
    for name, key in zip(SERVER_SUMS, ("server_step_ms", "server_itl_ms")):
        count = after.get(name + "_count", 0.0) - before.get(name + "_count", 0.0)
        total = after.get(name + "_sum", 0.0) - before.get(name + "_sum", 0.0)
        row[key] = round(1e3 * total / count, 2) if count else None
    row["server_steps"] = int(after.get(SERVER_SUMS[0] + "_count", 0.0)
                              - before.get(SERVER_SUMS[0] + "_count", 0.0))
    for name in SERVER_GAUGES:
        key = name.split(":")[1]
        row[key] = after.get(name)
    if row.get("iteration_overhead_seconds") is not None:
        row["iteration_overhead_ms"] = round(1e3 * row.pop("iteration_overhead_seconds"), 2)
    return row


def result_row(base: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """The JSONL line of one measurement from bench serve's result."""
    m = result["metrics"]
    finetune = result["finetune"] or {}
    return {
        **base,
        "timeline": result.get("timeline"),
        "num_requests": result["num_requests"], "num_completed": m["num_completed"],
        "num_failed": m["num_failed"], "first_errors": result["errors"],
        "tpot_attainment": m["slo_attainment"].get("tpot"),
        "ttft_attainment": m["slo_attainment"].get("ttft"),
        "goodput": m["goodput"], "request_throughput": m["request_throughput"],
        "output_throughput": m["output_throughput"],
        "total_token_throughput": m["total_token_throughput"],
        "window_s": m["duration_s"],
        "ttft_p50_ms": m["ttft_ms"]["p50"], "ttft_p99_ms": m["ttft_ms"]["p99"],
        "tpot_p50_ms": m["tpot_ms"]["p50"], "tpot_p99_ms": m["tpot_ms"]["p99"],
        "itl_p99_ms": m["itl_ms"]["p99"],
        "finetune_tokens_per_s": finetune.get("tokens_per_s"),
        "finetune_trained_tokens": finetune.get("trained_tokens"),
        "finetune_status": finetune.get("status"), "finetune_error": finetune.get("error"),
        "finetune_source": finetune.get("source"),
    }


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every configuration x rate; each line is appended to --output as soon as it exists."""
    began = time.monotonic()
    work_dir = args.state_dir or tempfile.mkdtemp(prefix="flexserve-coserve-")
    os.makedirs(work_dir, exist_ok=True)
    os.environ["FLEXSERVE_HOME"] = os.path.abspath(work_dir)  # the same models as the server
    flags = supported_server_flags()
    tokenizer_dir = write_word_tokenizer(args.model, os.path.join(work_dir, "word-tokenizer"))
    finetune_file = os.path.join(work_dir, "finetune.jsonl")
    write_finetune_file(finetune_file, args.finetune_num_sequences, *args.finetune_lengths,
                        seed=args.seed)
    max_len = max(args.max_model_len, max(args.finetune_lengths))
    common = [sys.executable, "-m", "flexserve.entrypoints.cli.main", "serve", "--model", args.model,
              "--load-format", "dummy", "--enable-lora", "--max-lora-rank", "16",
              "--state-dir", work_dir, "--max-model-len", str(max_len),
              "--max-finetune-len", str(max(args.finetune_lengths)),
              "--gpu-memory-utilization", str(args.gpu_memory_utilization),
              "--port", str(args.port), "--log-level", "warning", "--disable-log-stats"]
    if tokenizer_dir:
        common += ["--tokenizer", tokenizer_dir]
    # Checkpoints save and hot-load the adapter: keep them out of the measured windows.
    for flag, value in (("--slo-tpot-ms", args.slo_tpot_ms), ("--slo-ttft-ms", args.slo_ttft_ms),
                        ("--checkpoint-every-steps", 1_000_000)):
        if flag in flags:
            common += [flag, str(value)]
        else:
            print(f"note: this flexserve serve has no {flag}; the server runs its default")
    # One server per distinct option set (finetune-only shares coserve's), in --policies order.
    groups: dict[tuple[str, ...], list[str]] = {}
    for policy in args.policies:
        groups.setdefault(tuple(server_policy_args(policy)), []).append(policy)
    base = {"model": args.model, "burstiness": args.burstiness, "duration_s": args.duration,
            "trace": args.trace,
            "slo_tpot_ms": args.slo_tpot_ms, "slo_ttft_ms": args.slo_ttft_ms,
            "max_output_len": args.max_output_len, "finetune_lengths": args.finetune_lengths}
    rows: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(args.writer.write(row))  # stamped: gpu, date and command for the plot
        print(format_row(row), flush=True)

    for policy_args, policies in groups.items():
        # finetune-only first: the reference the co-served runs are measured against.
        runs = [(p, None if p == "finetune-only" or args.trace else r)
                for p in sorted(policies, key=lambda p: p != "finetune-only")
                for r in ([None] if p == "finetune-only" or args.trace else args.rates)]
        extra = list(policy_args)
        if "--coserve-policy" not in flags:
            if policies != ["inference-only"]:
                for policy, rate in runs:
                    emit({**base, "policy": policy, "rate": rate,
                          "error": "this flexserve serve has no --coserve-policy: skipped"})
                continue
            extra = []  # a server without co-serving policies serves inference only
        argv = common + extra + shlex.split(args.extra_server_args)
        if time.monotonic() - began + args.duration + 60 > args.time_budget:
            for policy, rate in runs:
                emit({**base, "policy": policy, "rate": rate, "error": "skipped: time budget"})
            continue
        print(f"starting: {shlex.join(argv[1:])}", flush=True)
        server = ServerProcess(argv, args.port, os.path.join(work_dir, f"server-{policies[0]}.log"))
        try:
            startup_s = server.wait_healthy(args.startup_timeout)
            warm_up(server.url)
        except (RuntimeError, httpx.HTTPError) as e:
            server.stop()
            for policy, rate in runs:
                emit({**base, "policy": policy, "rate": rate, "error": f"server: {e}"})
            continue
        try:
            for policy, rate in runs:
                line = {**base, "policy": policy, "rate": rate, "server_args": extra,
                        "server_startup_s": startup_s}
                if time.monotonic() - began + args.duration + 30 > args.time_budget:
                    emit({**line, "error": "skipped: time budget"})
                    continue
                try:
                    before = server_metrics(server.url)
                    result = run_benchmark(parse_bench_serve_args(
                        bench_argv(args, server.url, policy, rate, finetune_file)))
                    seen = server_row(before, server_metrics(server.url))
                except (ValueError, httpx.HTTPError) as e:
                    emit({**line, "error": f"{type(e).__name__}: {e}"})
                    continue
                emit({**result_row(line, result), "server": seen, "error": None})
        finally:
            server.stop()
    return rows


# ------------------------------------------------------------------------------------ report
def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_row(row: dict[str, Any]) -> str:
    """One markdown table row (see TABLE_HEADER)."""
    rate = "-" if row.get("rate") is None else f"{row['rate']:g}"
    pct = lambda v: _fmt(None if v is None else 100 * v, ".1f")  # noqa: E731
    return (f"| {row['policy']} | {rate} | {pct(row.get('tpot_attainment'))} | "
            f"{pct(row.get('ttft_attainment'))} | {_fmt(row.get('request_throughput'), '.2f')} | "
            f"{_fmt(row.get('output_throughput'), '.0f')} | {_fmt(row.get('tpot_p50_ms'), '.1f')}"
            f" / {_fmt(row.get('tpot_p99_ms'), '.1f')} | "
            f"{_fmt(row.get('finetune_tokens_per_s'), '.0f')} | {row.get('error') or ''} |")


TABLE_HEADER = ("| policy | rate (req/s) | TPOT SLO att. (%) | TTFT SLO att. (%) | req/s | "
                "output tok/s | TPOT p50 / p99 (ms) | fine-tuning tok/s | note |\n"
                "|---|---:|---:|---:|---:|---:|---:|---:|---|")


def evaluate_targets(rows: list[dict[str, Any]]) -> list[str]:
    """The three co-serving targets, each 'met' / 'NOT met' / 'not measured' with its numbers."""
    ok = [r for r in rows if not r.get("error")]
    at = {(r["policy"], r["rate"]): r for r in ok}
    rates = sorted({r["rate"] for r in ok if r["rate"] is not None})
    lines = []
    # 1. coserve holds >= 95% TPOT attainment wherever inference-only does.
    held = [x for x in rates if ((at.get(("inference-only", x)) or {}).get("tpot_attainment")
                                 or 0) >= TARGET_TPOT_ATTAINMENT]
    checks = [(x, (at.get(("coserve", x)) or {}).get("tpot_attainment")) for x in held]
    if not held:
        lines.append("coserve >= 95% TPOT attainment where inference-only holds it: not measured"
                     " (inference-only reaches 95% at no measured rate)")
    elif any(v is None for _, v in checks):
        lines.append("coserve >= 95% TPOT attainment where inference-only holds it: not measured"
                     " (coserve is missing at a rate where inference-only reaches 95%)")
    else:
        met = all(v >= TARGET_TPOT_ATTAINMENT for _, v in checks)
        detail = ", ".join(f"{x:g} req/s: {100 * v:.1f}%" for x, v in checks)
        lines.append(f"coserve >= 95% TPOT attainment where inference-only holds it: "
                     f"{'met' if met else 'NOT met'} ({detail})")
    # 2. fine-tuning keeps >= 76% of its solo throughput at the light (lowest) rate.
    solo = (at.get(("finetune-only", None)) or {}).get("finetune_tokens_per_s")
    light = (at.get(("coserve", rates[0])) or {}).get("finetune_tokens_per_s") if rates else None
    if not solo or light is None:
        lines.append("fine-tuning >= 76% of solo at the light rate: not measured")
    else:
        met = light >= TARGET_FINETUNE_FRACTION * solo
        lines.append(f"fine-tuning >= 76% of solo at the light rate: {'met' if met else 'NOT met'}"
                     f" ({light:.0f} / {solo:.0f} tok/s = {100 * light / solo:.1f}% at "
                     f"{rates[0]:g} req/s)")
    # 3. coserve's fine-tuning beats every temporal run that reaches its attainment.
    compared, losses = [], []
    for x in rates:
        co = at.get(("coserve", x))
        if co is None or co.get("tpot_attainment") is None:
            continue
        for name in TEMPORAL_POLICIES:
            t = at.get((name, x))
            if t is None or t.get("tpot_attainment") is None:
                continue
            if t["tpot_attainment"] + EQUAL_ATTAINMENT_TOLERANCE < co["tpot_attainment"]:
                continue  # lower attainment: not the comparison the target is about
            pair = (f"{x:g} req/s {name}: {co['finetune_tokens_per_s'] or 0:.0f} vs "
                    f"{t['finetune_tokens_per_s'] or 0:.0f} tok/s")
            compared.append(pair)
            if (co["finetune_tokens_per_s"] or 0) <= (t["finetune_tokens_per_s"] or 0):
                losses.append(pair)
    if not compared:
        lines.append("coserve fine-tuning > temporal sharing at equal attainment: not measured "
                     "(no temporal run at or above coserve's TPOT attainment)")
    else:
        lines.append(f"coserve fine-tuning > temporal sharing at equal attainment: "
                     f"{'NOT met' if losses else 'met'} ({'; '.join(losses or compared)})")
    return lines


def plot(rows: list[dict[str, Any]], path: str) -> bool:
    """TPOT attainment and fine-tuning tok/s vs rate per policy, as an SVG; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not importable here: no plot (later: --plot-only {path!r})")
        return False
    ok = [r for r in rows if not r.get("error")]
    fig, (ax_slo, ax_ft) = plt.subplots(1, 2, figsize=(11, 4))
    policies = list(dict.fromkeys(r["policy"] for r in ok if r["rate"] is not None))
    for i, policy in enumerate(policies):  # one colour per policy in both panels
        points = sorted((r["rate"], r) for r in ok if r["policy"] == policy)
        xs = [x for x, _ in points]
        style = {"label": policy, "color": f"C{i % 10}"}
        ax_slo.plot(xs, [100 * (r["tpot_attainment"] or 0) for _, r in points], "o-", **style)
        if policy != "inference-only":
            ax_ft.plot(xs, [r["finetune_tokens_per_s"] or 0 for _, r in points], "o-", **style)
    for r in ok:
        if r["policy"] == "finetune-only" and r["finetune_tokens_per_s"]:
            ax_ft.axhline(r["finetune_tokens_per_s"], ls="--", color="gray", label="finetune-only")
    ax_slo.axhline(100 * TARGET_TPOT_ATTAINMENT, ls=":", color="gray")
    slo = f"{ok[0]['slo_tpot_ms']:g}" if ok else "?"
    ax_slo.set(xlabel="arrival rate (req/s)", ylabel=f"TPOT SLO attainment (%, {slo} ms)",
               ylim=(0, 102))
    ax_ft.set(xlabel="arrival rate (req/s)", ylabel="fine-tuning throughput (tokens/s)")
    for ax in (ax_slo, ax_ft):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    title = f"{ok[0]['model']} on {ok[0]['gpu']}, {ok[0]['date']}" if ok else ""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, format="svg")
    print(f"plot: {path}")
    return True


def trace_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per time bin of a trace replay: the arrival rate, and each policy's TPOT attainment and
    fine-tuning tok/s, as markdown table lines."""
    runs = [r for r in rows if not r.get("error") and r.get("timeline")]
    if not runs:
        return []
    lines = ["| t (s) | req/s | " + " | ".join(
        f"{r['policy']} TPOT att. (%) | {r['policy']} fine-tuning tok/s" for r in runs) + " |",
             "|---:|---:|" + "---:|---:|" * len(runs)]
    pct = lambda v: _fmt(None if v is None else 100 * v, ".0f")  # noqa: E731
    for i, first in enumerate(runs[0]["timeline"]):
        cells = []
        for r in runs:
            b = r["timeline"][i] if i < len(r["timeline"]) else {}
            cells += [pct(b.get("tpot_attainment")), _fmt(b.get("finetune_tokens_per_s"), ".0f")]
        lines.append(f"| {first['t_s']:g} | {first['request_rate']:.1f} | " + " | ".join(cells)
                     + " |")
    return lines


def plot_trace(rows: list[dict[str, Any]], path: str) -> bool:
    """TPOT attainment and fine-tuning tok/s over the time of a trace replay, per policy, with the
    arrival rate; an SVG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not importable here: no plot (later: --plot-only {path!r})")
        return False
    runs = [r for r in rows if not r.get("error") and r.get("timeline")]
    fig, (ax_slo, ax_ft) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for i, r in enumerate(runs):
        ts = [b["t_s"] for b in r["timeline"]]
        style = {"label": r["policy"], "color": f"C{i % 10}"}
        ax_slo.plot(ts, [None if b["tpot_attainment"] is None else 100 * b["tpot_attainment"]
                         for b in r["timeline"]], "o-", **style)
        ax_ft.plot(ts, [b["finetune_tokens_per_s"] for b in r["timeline"]], "o-", **style)
    if runs:
        rate = ax_slo.twinx()
        rate.step([b["t_s"] for b in runs[0]["timeline"]],
                  [b["request_rate"] for b in runs[0]["timeline"]], where="post", color="gray",
                  alpha=0.5)
        rate.set_ylabel("arrivals (req/s)")
    ax_slo.axhline(100 * TARGET_TPOT_ATTAINMENT, ls=":", color="gray")
    ax_slo.set(ylabel="TPOT SLO attainment (%)", ylim=(0, 102))
    ax_ft.set(xlabel="time (s)", ylabel="fine-tuning throughput (tokens/s)")
    for ax in (ax_slo, ax_ft):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if runs:
        fig.suptitle(f"{runs[0]['model']} on {runs[0]['gpu']}, {runs[0]['date']}: "
                     f"{os.path.basename(runs[0].get('trace') or '')}")
    fig.tight_layout()
    fig.savefig(path, format="svg")
    print(f"plot: {path}")
    return True


def report(rows: list[dict[str, Any]], plot_path: str | None) -> None:
    print(TABLE_HEADER)
    for row in rows:
        print(format_row(row))
    traced = trace_table(rows)
    if traced:
        print()
        print("\n".join(traced))
        if plot_path:
            plot_trace(rows, plot_path)
        return
    print("\nTargets:")
    for line in evaluate_targets(rows):
        print(f"- {line}")
    if plot_path:
        plot(rows, plot_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b", help="[%(default)s]")
    parser.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES,
                        help="configurations, in order [all]")
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, 12.0, 20.0],
                        help="mean arrivals/s: light, medium, heavy [4 12 20, FlexLLM's range]")
    parser.add_argument("--duration", type=float, default=8.0,
                        help="seconds of arrivals per run (in-flight requests then finish) "
                             "[%(default)s]")
    parser.add_argument("--burstiness", type=float, default=0.5,
                        help="gamma shape of inter-arrivals (< 1: bursty) [%(default)s]")
    parser.add_argument("--max-model-len", type=int, default=8192,
                        help="inference context (the server gets at least the longest "
                             "fine-tuning sequence) [%(default)s]")
    parser.add_argument("--max-output-len", type=int, default=256,
                        help="cap on ShareGPT-like outputs (bounds the drain) [%(default)s]")
    parser.add_argument("--finetune-lengths", type=int, nargs=2, default=[1024, 8192],
                        metavar=("MIN", "MAX"), help="training sequence tokens [1024 8192]")
    parser.add_argument("--finetune-num-sequences", type=int, default=64, help="[%(default)s]")
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0, help="[%(default)s]")
    parser.add_argument("--slo-ttft-ms", type=float, default=5000.0,
                        help="FlexLLM's 5 s cap on queueing [%(default)s]")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                        help="server's KV cache share; the rest holds fine-tuning state "
                             "[%(default)s]")
    parser.add_argument("--port", type=int, default=8321, help="[%(default)s]")
    parser.add_argument("--extra-server-args", default="", help="appended to every server")
    parser.add_argument("--state-dir", default=None,
                        help="server state, logs, generated inputs [a new temporary directory]")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="[%(default)s]")
    parser.add_argument("--time-budget", type=float, default=540.0,
                        help="skip runs that would end after this many seconds [%(default)s]")
    parser.add_argument("--seed", type=int, default=0, help="[%(default)s]")
    parser.add_argument("--trace", nargs="?", const=DEFAULT_TRACE, default=None, metavar="FILE",
                        help="replay a JSONL/CSV arrival trace (flexserve.bench.trace) once per "
                             "policy instead of --rates; without FILE the shipped bursty trace "
                             "(2 -> 20 -> 2 req/s over 90 s)")
    parser.add_argument("--trace-bin-s", type=float, default=5.0,
                        help="seconds per point of the trace's timeline [%(default)s]")
    harness.add_out_argument(parser, default=harness.AUTO_OUT, aliases=("--output",))
    parser.add_argument("--plot", default=None, help="SVG of attainment and fine-tuning tok/s")
    parser.add_argument("--plot-only", default=None, metavar="RESULTS.jsonl",
                        help="no runs: table, targets and --plot from an earlier output")
    args = parser.parse_args(argv)
    if args.plot_only:
        report(harness.read_jsonl(args.plot_only), args.plot)
        return 0
    for policy in args.policies:
        try:
            server_policy_args(policy)
        except ValueError as e:
            parser.error(str(e))
    lo, hi = args.finetune_lengths
    if not 2 <= lo <= hi:
        parser.error(f"--finetune-lengths needs 2 <= MIN <= MAX, got {lo} {hi}")
    args.writer = harness.JsonlWriter(args.out, __file__, echo=None, argv=argv)
    print(TABLE_HEADER, flush=True)
    rows = run_all(args)
    print()
    report(rows, args.plot)
    print(f"results appended to {args.writer.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

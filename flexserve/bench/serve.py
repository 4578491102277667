"""`flexserve bench serve`: an online serving benchmark against a running OpenAI-compatible server.

vLLM's `benchmark_serving` semantics: requests are sent at arrival times drawn from a gamma process
(`--burstiness` is the shape k: 1 is Poisson, k < 1 burstier, with mean inter-arrival 1/rate), each
streamed over SSE, and the client measures per request TTFT (to the first chunk carrying text),
TPOT = (e2e - ttft) / (output_tokens - 1), every inter-token gap (ITL: a chunk that brings several
tokens, their text held back until a character is whole, counts its gap split over them, from the
usage the server reports in every chunk) and E2E. Output tokens are
counted from the stream's usage chunk. Goodput is the completed requests per second that meet
every given SLO; the attainment of one SLO is the fraction of completed requests meeting it.

With `--finetune-file` it also uploads the file, starts a LoRA fine-tuning job before the traffic
and reports the job's fine-tuning tokens per second over the inference run window (first request
sent to last request done), from `/metrics` (`flexserve:finetune_tokens_total{phase="forward"}`
of the job), else from the job's `trained_tokens`. `--num-prompts 0 --duration S` measures the
job alone for S seconds. `--trace FILE` replays a trace's arrival times (and its prompt and
output lengths where it has them) instead of the gamma process, and the result gains a
`timeline`: per `--trace-bin-s` seconds, the arrival rate, the TPOT SLO attainment of the
requests that arrived and the fine-tuning tokens per second.

The workload (datasets, arrival times) is in `bench.workload`, traces in `bench.trace`, the
metrics in `bench.metrics` and the fine-tuning job in `bench.finetune`; this module sends the
requests and holds the options.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

import httpx

from flexserve import envs
from flexserve.bench.finetune import (
    FinetuneMonitor,
    add_finetune_arguments,
    error_message,
)
from flexserve.bench.metrics import RequestRecord, aggregate_metrics, format_report
from flexserve.bench.trace import TraceEntry, load_trace, timeline
from flexserve.bench.workload import (
    DATASET_NAMES,
    SHAREGPT_INPUT_MEDIAN,
    SHAREGPT_INPUT_SIGMA,
    SHAREGPT_OUTPUT_MEDIAN,
    SHAREGPT_OUTPUT_SIGMA,
    SampledRequest,
    check_min,
    iter_arrival_times,
    iter_random_requests,
    iter_sharegpt_like_requests,
    load_jsonl_requests,
    random_text,
)


# ------------------------------------------------------------------------------------ client
def _request_body(endpoint: str, model: str, sampled: SampledRequest, tenant: str | None,
                  ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "stream": True,
        # Usage in every chunk (vLLM's extension): the tokens each chunk carries, so a chunk
        # that brings several (text held back until a character is whole) counts as several
        # inter-token gaps.
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "temperature": 0.0, "ignore_eos": ignore_eos,
    }
    if endpoint == "chat":
        body.update(messages=[{"role": "user", "content": sampled.prompt}],
                    max_completion_tokens=sampled.output_len)
    else:
        body.update(prompt=sampled.prompt, max_tokens=sampled.output_len)
    if tenant is not None:
        body["user"] = tenant
    return body


def _chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(client: httpx.AsyncClient, endpoint: str, body: dict[str, Any],
                       record: RequestRecord, start: float, api_key: str | None = None,
                       ) -> RequestRecord:
    """Stream one request, filling `record`'s timings and token counts (or its error).
    `api_key`: sent instead of the client's own (a tenant's key)."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    sent = time.perf_counter()
    record.sent_s = sent - start
    num_text_chunks, last, usage, done = 0, sent, None, False
    tokens_seen = 0  # completion tokens reported up to the last text chunk
    try:
        headers = None if api_key is None else {"Authorization": f"Bearer {api_key}"}
        async with client.stream("POST", path, json=body, headers=headers) as response:
            if response.status_code != 200:
                record.error = error_message(response, await response.aread())
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    record.error = f"in stream: {message}"
                    return record
                usage = chunk.get("usage") or usage
                if _chunk_text(chunk, endpoint):
                    # Tokens this chunk brings: from its usage when the server reports one
                    # per chunk, else one.
                    tokens = int((chunk.get("usage") or {}).get("completion_tokens", 0))
                    new = tokens - tokens_seen if tokens > tokens_seen else 1
                    tokens_seen = max(tokens, tokens_seen + 1)
                    if record.ttft_s is None:
                        record.ttft_s = now - sent
                    else:
                        record.itl_s += [(now - last) / new] * new
                    last = now
                    num_text_chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    if not done:
        record.error = "the stream ended without data: [DONE]"
        return record
    record.e2e_s = time.perf_counter() - sent
    if usage:
        record.prompt_tokens = int(usage.get("prompt_tokens", 0))
        record.output_tokens = int(usage.get("completion_tokens", 0))
    else:
        record.output_tokens = num_text_chunks
    if record.ttft_s is None:  # the output decoded to no text: the end is all we saw
        record.ttft_s = record.e2e_s
    return record


# ------------------------------------------------------------------------------------ runner
async def _served_model(client: httpx.AsyncClient, model: str | None) -> tuple[str, int | None]:
    """The model to benchmark (default: the first listed) and its max_model_len if listed."""
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at {client.base_url}: {e}") from e
    if response.status_code != 200:
        raise ValueError(f"GET /v1/models: {error_message(response, response.content)}")
    cards = response.json().get("data") or []
    if model is None:
        if not cards:
            raise ValueError("the server lists no models; pass --model")
        return cards[0]["id"], cards[0].get("max_model_len")
    card = next((c for c in cards if c.get("id") == model), {})
    return model, card.get("max_model_len")


def _request_stream(args: argparse.Namespace, max_model_len: int) -> Iterator[SampledRequest]:
    if args.dataset_name == "random":
        return iter_random_requests(args.input_len, args.output_len, args.seed)
    if args.dataset_name == "sharegpt-like":
        return iter_sharegpt_like_requests(args.seed, max_model_len, args.sharegpt_max_output_len)
    if not args.dataset_path:
        raise ValueError("--dataset-name jsonl needs --dataset-path")
    return itertools.cycle(load_jsonl_requests(args.dataset_path, args.output_len))


def _check_args(args: argparse.Namespace) -> int | None:
    """The number of requests to send (None: until --duration); ValueError on bad options."""
    if args.endpoint not in ("completions", "chat"):
        raise ValueError(f"--endpoint must be completions or chat, got {args.endpoint!r}")
    if args.duration is not None and not (args.duration > 0 and math.isfinite(args.duration)):
        raise ValueError(f"--duration must be a finite number of seconds > 0, got "
                         f"{args.duration}")
    num = args.num_prompts
    if args.trace:
        if not math.isinf(args.request_rate):
            raise ValueError("--trace gives the arrival times: drop --request-rate")
        if not (args.trace_bin_s > 0 and math.isfinite(args.trace_bin_s)):
            raise ValueError(f"--trace-bin-s must be a finite number > 0, got "
                             f"{args.trace_bin_s}")
        if not os.path.isfile(args.trace):
            raise ValueError(f"--trace {args.trace!r} is not a file")
    if num is None:
        num = None if args.duration is not None or args.trace else 1000
    elif num < 0:
        raise ValueError(f"--num-prompts must be >= 0, got {num}")
    if num is None and math.isinf(args.request_rate) and not args.trace:
        raise ValueError("--request-rate inf with --duration needs --num-prompts")
    if num == 0 and (args.duration is None or not args.finetune_file):
        raise ValueError("--num-prompts 0 measures a fine-tuning job alone: it needs "
                         "--finetune-file and --duration")
    if args.max_concurrency is not None:
        check_min("max-concurrency", args.max_concurrency, 1)
    if args.tenants is not None:
        check_min("tenants", args.tenants, 1)
    if args.tenant_keys is not None:
        args.tenant_key_pairs = read_tenant_keys(args.tenant_keys)
    return num


def read_tenant_keys(path: str) -> list[tuple[str, str]]:
    """(tenant, key) of each `tenant:key` line of `path` (blank lines and `#` comments
    skipped): the server's --api-key-file format."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            tenant, sep, key = line.partition(":")
            if not sep or not tenant.strip() or not key.strip():
                raise ValueError(f"--tenant-keys {path}, line {number}: expected tenant:key")
            pairs.append((tenant.strip(), key.strip()))
    if not pairs:
        raise ValueError(f"--tenant-keys {path} holds no keys")
    return pairs


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark the options describe; the result dict (`--output-json`'s content)."""
    num_requests = _check_args(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No connection cap unless --max-concurrency: httpx's default of 100 would queue requests
    # client-side and hide the server's queueing from TTFT.
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=60.0)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                 limits=limits, timeout=timeout) as client:
        model, listed_max_len = await _served_model(client, args.model)
        max_model_len = args.max_model_len or listed_max_len or 2048
        sampled = _request_stream(args, max_model_len)
        monitor = None
        if args.finetune_file:
            monitor = FinetuneMonitor.from_args(client, model, args)
        try:
            records, duration_s = await _send_all(args, client, model, num_requests, sampled,
                                                  monitor)
            finetune = None if monitor is None else await monitor.end_window()
        except BaseException:
            if monitor is not None:  # no job left running behind a failed benchmark
                await monitor.cancel_quietly()
            raise
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": args.base_url, "model": model, "endpoint": args.endpoint,
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("handler", "api_key", "tenant_key_pairs") and not callable(v)},
        "num_requests": len(records),
        "metrics": aggregate_metrics(records, duration_s, args.metric_percentiles,
                                     args.slo_ttft_ms, args.slo_tpot_ms),
        "errors": [f"request {r.index}: {r.error}" for r in records if r.error][:5],
        "finetune": finetune,
        "timeline": None if not args.trace else timeline(
            [r.to_dict() for r in records], None if finetune is None else finetune["samples"],
            args.trace_bin_s, args.slo_tpot_ms),
        "requests": [r.to_dict() for r in records],
    }


async def _send_all(args: argparse.Namespace, client: httpx.AsyncClient, model: str,
                    num_requests: int | None, sampled: Iterator[SampledRequest],
                    monitor: FinetuneMonitor | None) -> tuple[list[RequestRecord], float]:
    """Send at the arrival times until the count or the duration is reached; the records and
    the seconds from the first send to the last completion."""
    from tqdm.auto import tqdm

    if monitor is not None:
        await monitor.submit()
    if args.trace:
        entries = load_trace(args.trace)
        arrivals = (e.arrival_s for e in entries)
        sampled = _with_trace_lengths(sampled, entries, args.seed)
    else:
        arrivals = iter_arrival_times(args.request_rate, args.burstiness, args.seed)
    semaphore = asyncio.Semaphore(args.max_concurrency or 1 << 30)
    progress = tqdm(total=num_requests, disable=args.disable_tqdm, desc="requests")

    tenant_keys = getattr(args, "tenant_key_pairs", None)

    async def run(record: RequestRecord, body: dict[str, Any],
                  api_key: str | None) -> RequestRecord:
        async with semaphore:
            await send_request(client, args.endpoint, body, record, start, api_key)
        progress.update(1)
        return record

    if monitor is not None:
        await monitor.begin_window()
    start = time.perf_counter()
    tasks: list[asyncio.Task[RequestRecord]] = []
    for index, (request, arrival) in enumerate(zip(sampled, arrivals)):
        if num_requests is not None and index >= num_requests:
            break
        if args.duration is not None and arrival >= args.duration:
            break
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tenant = None if args.tenants is None else f"tenant-{index % args.tenants}"
        api_key = None
        if tenant_keys is not None:
            tenant, api_key = tenant_keys[index % len(tenant_keys)]
        record = RequestRecord(index, tenant, arrival, request.prompt_len, request.output_len)
        body = _request_body(args.endpoint, model, request, tenant, args.ignore_eos)
        tasks.append(asyncio.create_task(run(record, body, api_key)))
    if not tasks and args.duration is not None:  # the fine-tuning job alone
        await asyncio.sleep(max(0.0, start + args.duration - time.perf_counter()))
    try:
        records = list(await asyncio.gather(*tasks))
    finally:
        progress.close()
    return records, time.perf_counter() - start


def _with_trace_lengths(sampled: Iterator[SampledRequest], entries: list[TraceEntry],
                        seed: int) -> Iterator[SampledRequest]:
    """The dataset's requests, with a trace entry's prompt and output lengths where it has
    them (a prompt of that many random words)."""
    rng = random.Random(f"trace-{seed}")
    for entry, request in zip(entries, sampled):
        if entry.prompt_len is None and entry.output_len is None:
            yield request
            continue
        prompt_len = entry.prompt_len or request.prompt_len
        prompt = (random_text(rng, prompt_len) if entry.prompt_len is not None
                  else request.prompt)
        yield SampledRequest(prompt, prompt_len, entry.output_len or request.output_len)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """`benchmark` from synchronous code; writes `--output-json` when given."""
    result = asyncio.run(benchmark(args))
    if args.output_json:
        directory = os.path.dirname(os.path.abspath(args.output_json))
        os.makedirs(directory, exist_ok=True)
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return result


def run_bench_serve(args: argparse.Namespace) -> int:
    """The `flexserve bench serve` handler: run, print the table, write the JSON."""
    print(format_report(run_benchmark(args)))
    return 0


# ------------------------------------------------------------------------------------ options
def _percentiles(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e
    if not values or not all(0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100], got {text!r}")
    return values


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `flexserve bench serve` (vLLM's names where it has them)."""
    group = parser.add_argument_group("server")
    group.add_argument("--base-url", default="http://127.0.0.1:8000", help="[%(default)s]")
    group.add_argument("--model", default=None, help="[the first of GET /v1/models]")
    group.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                       help="/v1/completions or /v1/chat/completions [%(default)s]")
    group.add_argument("--api-key",
                       default=envs.api_key() or os.environ.get("OPENAI_API_KEY"),
                       help="sent as `Authorization: Bearer KEY` [$FLEXSERVE_API_KEY, else "
                            "$OPENAI_API_KEY, else none]")
    group.add_argument("--request-timeout", type=float, default=3600.0,
                       help="seconds one request may take [%(default)s]")
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset-name", choices=DATASET_NAMES, default="random",
                       help="random: fixed lengths; sharegpt-like: log-normal prompt and output "
                            f"lengths (medians {SHAREGPT_INPUT_MEDIAN}/{SHAREGPT_OUTPUT_MEDIAN}, "
                            f"sigma {SHAREGPT_INPUT_SIGMA:g}/{SHAREGPT_OUTPUT_SIGMA:g}); "
                            'jsonl: {"prompt", optional "output_len"} lines [%(default)s]')
    group.add_argument("--dataset-path", default=None, help="the JSONL file (jsonl)")
    group.add_argument("--input-len", type=int, default=512,
                       help="random: prompt words, about one token each [%(default)s]")
    group.add_argument("--output-len", type=int, default=128,
                       help="random, and jsonl lines without output_len: max_tokens "
                            "[%(default)s]")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="sharegpt-like: prompt + output bound [the server's, else 2048]")
    group.add_argument("--sharegpt-max-output-len", type=int, default=None,
                       help="sharegpt-like: cap outputs further [none]")
    group.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                       help="generate exactly max_tokens per request [on]")
    group.add_argument("--num-prompts", type=int, default=None,
                       help="requests to send [1000; unbounded with --duration]")
    group.add_argument("--duration", type=float, default=None,
                       help="stop sending after this many seconds (in-flight requests finish)")
    group.add_argument("--trace", default=None, metavar="FILE",
                       help="replay the arrival times (and prompt/output lengths where given) "
                            "of a JSONL or CSV trace instead of --request-rate "
                            "(flexserve.bench.trace)")
    group.add_argument("--trace-bin-s", type=float, default=5.0,
                       help="with --trace: seconds per bin of the result's timeline "
                            "[%(default)s]")
    group.add_argument("--request-rate", type=float, default=float("inf"),
                       help="mean requests/s; inf sends all at once [%(default)s]")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of the inter-arrival times: 1 Poisson, < 1 burstier "
                            "[%(default)s]")
    group.add_argument("--max-concurrency", type=int, default=None,
                       help="requests in flight at most [unbounded]")
    group.add_argument("--tenants", type=int, default=None,
                       help="round-robin the requests over users tenant-0..N-1 (the `user` field, "
                            "an end-user id: the server accounts by API key, see --tenant-keys)")
    group.add_argument("--tenant-keys", default=None, metavar="FILE",
                       help="round-robin the requests over the tenants of FILE (`tenant:key` "
                            "lines, the server's --api-key-file): each is sent with its tenant's "
                            "key, so the server's fairness sees the tenants")
    group.add_argument("--seed", type=int, default=0, help="arrivals and prompts [%(default)s]")
    group = parser.add_argument_group("report")
    group.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO for goodput")
    group.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO for goodput")
    group.add_argument("--metric-percentiles", type=_percentiles, default=[50.0, 90.0, 99.0],
                       help="comma-separated [50,90,99]")
    group.add_argument("--output-json", default=None,
                       help="write settings, statistics and per-request records here")
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    group.add_argument("--log-level", default="warning",
                       choices=("critical", "error", "warning", "info", "debug"))
    add_finetune_arguments(parser)


def add_bench_serve_parser(kinds: Any) -> None:
    """Register `serve` on `flexserve bench`'s subparsers (a client: no engine options)."""
    parser = kinds.add_parser(
        "serve", help="online serving benchmark against a running server",
        description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_bench_serve_arguments(parser)
    parser.set_defaults(handler=run_bench_serve, command="bench")


def parse_bench_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """The options of `flexserve bench serve ARGV...`, for running it programmatically."""
    parser = argparse.ArgumentParser(prog="flexserve bench serve")
    add_bench_serve_arguments(parser)
    return parser.parse_args(list(argv))

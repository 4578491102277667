"""`flexserve bench throughput|latency`: offline benchmarks with vLLM's benchmark semantics.

throughput (vLLM's `benchmark_throughput`): `--num-prompts` prompts of `--input-len` random tokens
(or the prompts of a JSONL `--dataset`), each generating exactly `--output-len` tokens (greedy,
EOS ignored), all submitted at once to `LLM.generate`; reports requests/s, total tokens/s and
output tokens/s over the wall time of the whole run.

latency (vLLM's `benchmark_latency`): one batch of `--batch-size` prompts, timed end to end over
`--num-iters` runs after warm-up; also times the same batch with one output token (time to first
token) and derives the time per output token TPOT = (e2e - ttft) / (output_len - 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any

from flexserve.entrypoints.cli.args import (
    add_engine_arguments,
    apply_state_dir,
    engine_config_from_args,
)

logger = logging.getLogger("flexserve.bench")


def add_bench_parser(commands: Any) -> None:
    """Register `flexserve bench {throughput,latency,serve}` on the top-level subparsers."""
    from flexserve.bench.serve import add_bench_serve_parser

    bench = commands.add_parser("bench", help="offline (throughput, latency) and online (serve) "
                                "benchmarks",
                                description="Benchmarks (vLLM's benchmark semantics).")
    kinds = bench.add_subparsers(dest="bench_kind", required=True, metavar="KIND")
    throughput = kinds.add_parser("throughput", help="requests/s and tokens/s of a batch run")
    throughput.add_argument("--num-prompts", type=int, default=256, help="[%(default)s]")
    throughput.add_argument("--dataset", default=None,
                            help='JSONL file with {"prompt": text} per line [random tokens]')
    latency = kinds.add_parser("latency", help="end-to-end latency, TTFT and TPOT of one batch")
    latency.add_argument("--batch-size", type=int, default=1, help="[%(default)s]")
    latency.add_argument("--num-iters-warmup", type=int, default=2, help="[%(default)s]")
    latency.add_argument("--num-iters", type=int, default=5, help="[%(default)s]")
    for parser, handler in ((throughput, run_throughput), (latency, run_latency)):
        parser.add_argument("--input-len", type=int, default=512,
                            help="prompt tokens (random prompts) [%(default)s]")
        parser.add_argument("--output-len", type=int, default=128,
                            help="generated tokens per prompt [%(default)s]")
        parser.add_argument("--output-json", default=None, help="also write the results here")
        parser.add_argument("--log-level", default="warning",
                            choices=("critical", "error", "warning", "info", "debug"))
        add_engine_arguments(parser)
        parser.set_defaults(handler=handler, command="bench")
    add_bench_serve_parser(kinds)  # a client of a running server: no engine options


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _llm(args: argparse.Namespace, max_num_seqs: int, max_len: int,
         prefix_caching: bool = True) -> Any:
    """An LLM built from the engine options, sized for this benchmark when they are defaults."""
    from flexserve.entrypoints.llm import LLM

    apply_state_dir(args)
    if args.max_model_len is None:
        args.max_model_len = max_len
    config = engine_config_from_args(args)
    config.scheduler.max_num_seqs = min(config.scheduler.max_num_seqs, max(max_num_seqs, 1))
    config.disable_log_stats = True
    config.cache.enable_prefix_caching = config.cache.enable_prefix_caching and prefix_caching
    return LLM.from_engine_config(config)


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Token-id prompts drawn uniformly, avoiding the first/last 100 ids (special tokens)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    low, high = min(100, vocab_size // 4), max(vocab_size - 100, vocab_size * 3 // 4)
    return torch.randint(low, high, (num, input_len), generator=g).tolist()


def read_dataset(path: str, num_prompts: int) -> list[str]:
    """The first `num_prompts` prompts of a JSONL file; ValueError naming the bad line."""
    prompts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number}: not JSON ({e})") from e
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) \
                    or not item["prompt"]:
                raise ValueError(f'{path} line {number}: expected {{"prompt": "non-empty text"}}')
            prompts.append(item["prompt"])
            if len(prompts) == num_prompts:
                break
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts


def _report(args: argparse.Namespace, result: dict[str, Any], lines: list[str]) -> None:
    for line in lines:
        print(line)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


def run_throughput(args: argparse.Namespace) -> int:
    from flexserve.sampling_params import SamplingParams

    _check_positive(num_prompts=args.num_prompts, input_len=args.input_len,
                    output_len=args.output_len)
    llm = _llm(args, args.num_prompts, args.input_len + args.output_len)
    if args.dataset:
        prompts: list[Any] = read_dataset(args.dataset, args.num_prompts)
    else:
        prompts = random_prompts(args.num_prompts, args.input_len, llm.engine.info.vocab_size,
                                 args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    num_output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = {
        "elapsed_time": elapsed, "num_requests": len(outputs),
        "total_num_tokens": num_prompt_tokens + num_output_tokens,
        "num_output_tokens": num_output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (num_prompt_tokens + num_output_tokens) / elapsed,
        "output_tokens_per_second": num_output_tokens / elapsed,
        "config": _config_summary(args, llm),
    }
    _report(args, result, [
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s",
        f"Total num prompt tokens: {num_prompt_tokens}",
        f"Total num output tokens: {num_output_tokens}",
    ])
    return 0


def run_latency(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from flexserve.sampling_params import SamplingParams

    _check_positive(batch_size=args.batch_size, input_len=args.input_len,
                    output_len=args.output_len, num_iters=args.num_iters)
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    # Every iteration sends the same prompts: the prefix cache would hide the prefill.
    llm = _llm(args, args.batch_size, args.input_len + args.output_len, prefix_caching=False)
    prompts = random_prompts(args.batch_size, args.input_len, llm.engine.info.vocab_size,
                             args.seed)
    full = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def timed(params: SamplingParams) -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in tqdm(range(args.num_iters_warmup), desc="warm-up"):
        timed(full)
    e2e = sorted(timed(full) for _ in tqdm(range(args.num_iters), desc="end to end"))
    ttft = sorted(timed(first) for _ in tqdm(range(args.num_iters), desc="first token"))
    median = lambda v: v[len(v) // 2]  # noqa: E731
    tpot = (median(e2e) - median(ttft)) / max(args.output_len - 1, 1)
    result = {
        "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "latencies": e2e, "avg_latency": sum(e2e) / len(e2e), "median_latency": median(e2e),
        "median_ttft": median(ttft), "tpot": tpot,
        "output_tokens_per_second": args.batch_size * args.output_len / median(e2e),
        "config": _config_summary(args, llm),
    }
    _report(args, result, [
        f"Avg latency: {result['avg_latency']:.4f} s (median {median(e2e):.4f} s, "
        f"min {e2e[0]:.4f} s, max {e2e[-1]:.4f} s)",
        f"TTFT (median): {median(ttft) * 1e3:.2f} ms | TPOT: {tpot * 1e3:.2f} ms | "
        f"{result['output_tokens_per_second']:.1f} output tokens/s",
    ])
    return 0


def _config_summary(args: argparse.Namespace, llm: Any) -> dict[str, Any]:
    info = llm.engine.info
    return {"model": info.name, "device": info.device, "dtype": info.dtype,
            "enforce_eager": args.enforce_eager, "load_format": args.load_format,
            "max_model_len": info.max_model_len}

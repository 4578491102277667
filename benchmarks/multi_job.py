"""Many LoRA fine-tuning jobs on one backbone: aggregate trained tokens/s and peak extra memory,
the jobs running concurrently (sequences of all jobs packed into shared bins, their windows in the
same iterations) against the same jobs one after another.

    python benchmarks/multi_job.py --model llama-3.1-8b --num-jobs 1 2 4 8 16 \
        --max-lora-rank 16 --finetune-job-memory-gib 16 --out

Every job trains LoRA r=--rank on every target module over --examples-per-job random-token
examples whose lengths follow a skewed distribution (Pareto: most near --min-len, a long tail
capped at --max-len), in steps of --batch-size; job i's data and seed are the same in both modes.
Concurrent: every job is added at once (a job the fine-tuning slots or memory cannot take yet is
added as soon as one ends, as the job service does); sequential: one job at a time. Tokens/s
counts every job's forward tokens over the wall time from the first job's start to the last
one's end; "start_seconds" is the part spent starting jobs (on CUDA their graph captures) and
"training_tokens_per_s" the tokens over the rest; peak memory is
max_memory_allocated during the run less what was allocated before (CUDA only). A short job runs
first, to compile kernels and warm the allocator; its start (with the graph captures its plan
needs on CUDA) is written as the "first job" row. `--profile` then runs the largest
--num-jobs concurrently once more under cProfile and torch.profiler (untimed): the device's busy
time, its top kernels and the top host functions.

CPU smoke test (a tiny random Llama, seconds):

    python benchmarks/multi_job.py --tiny --num-jobs 1 2 4
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def skewed_lengths(num: int, min_len: int, max_len: int, alpha: float, seed: int) -> list[int]:
    """Pareto(alpha) lengths from min_len, capped at max_len: most short, a long tail."""
    rng = random.Random(seed)
    return [min(max_len, int(min_len * rng.paretovariate(alpha))) for _ in range(num)]


def tiny_model_dir() -> str:
    from transformers import AutoModelForCausalLM

    config = harness.tiny_llama_config(vocab_size=256, hidden_size=64, num_layers=2, max_len=512)
    path = tempfile.mkdtemp(prefix="flexserve-multi-job-")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def make_job(index: int, args: argparse.Namespace, vocab: int):
    from flexserve.finetune.data import TrainingData, TrainingExample
    from flexserve.finetune.hyperparameters import Hyperparameters

    lengths = skewed_lengths(args.examples_per_job, args.min_len, args.max_len, args.alpha,
                             seed=index)
    g = torch.Generator().manual_seed(index)
    examples = [TrainingExample(i + 1, torch.randint(3, vocab - 3, (n,), generator=g).tolist(),
                                [False] + [True] * (n - 1)) for i, n in enumerate(lengths)]
    data = TrainingData("text", examples, [], sum(lengths), sum(n - 1 for n in lengths))
    hp = Hyperparameters.from_dict({
        "batch_size": args.batch_size, "n_epochs": 1, "shuffle": False, "seed": index,
        "learning_rate": 1e-4, "max_seq_len": args.max_len,
        "lora": {"r": args.rank, "alpha": 2 * args.rank, "target_modules": ALL}})
    return data, hp


def run(engine, jobs: list, concurrent: bool) -> dict:
    """Train these jobs to the end; tokens, seconds, peak extra bytes, most jobs at once and
    packing rounds by method."""
    from flexserve.engine.finetune_capacity import FinetuneCapacityError

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    rounds_before = dict(engine.scheduler.finetune.packing_methods)
    runner = getattr(engine.executor, "finetune_runner", None)  # None: the ranks hold it
    windows_before = dict(runner.num_backward_windows) if runner is not None else None
    pending = list(jobs)
    running: list = []
    num_tokens, max_running, starting = 0, 0, 0.0
    start = time.perf_counter()
    while pending or running:
        while pending and (concurrent or not running):
            t0 = time.perf_counter()
            try:
                running.append(engine.add_finetune_job(*pending[0]))
            except FinetuneCapacityError:
                if not running:
                    raise
                break
            finally:
                starting += time.perf_counter() - t0
            pending.pop(0)
        max_running = max(max_running, len(running))
        engine.step()
        for state in [s for s in running if s.finished]:
            if state.status.value != "succeeded":
                raise RuntimeError(f"job {state.job_id} {state.status.value}: {state.error}")
            num_tokens += state.num_forward_tokens
            engine.remove_finetune_job(state.job_id)
            running.remove(state)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - before if cuda else None
    rounds = {method: count - rounds_before[method]
              for method, count in engine.scheduler.finetune.packing_methods.items()}
    windows = None if runner is None else {
        how: count - windows_before[how] for how, count in runner.num_backward_windows.items()}
    return {"tokens": num_tokens, "seconds": elapsed, "start_seconds": starting,
            "peak_extra_bytes": peak, "max_running": max_running, "packing_rounds": rounds,
            "backward_windows": windows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny random Llama on the CPU (smoke test): lengths 8-256")
    parser.add_argument("--num-jobs", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--modes", nargs="+", choices=["concurrent", "sequential"],
                        default=["concurrent", "sequential"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--examples-per-job", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--alpha", type=float, default=1.2,
                        help="Pareto shape of the lengths (smaller: a heavier tail) [%(default)s]")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--max-lora-rank", type=int, default=None,
                        help="width of every LoRA slot [--rank]")
    parser.add_argument("--max-finetune-loras", type=int, default=None,
                        help="fine-tuning slots [sized from the job memory]")
    parser.add_argument("--finetune-job-memory-gib", type=float, default=None,
                        help="memory for the jobs' slots and training state [5%% of the GPU]")
    parser.add_argument("--finetune-packing-time-limit", type=float, default=0.05)
    parser.add_argument("--batched-backward", action="store_true",
                        help="run the backward windows of the jobs of one plan as one "
                             "(--finetune-batched-backward)")
    parser.add_argument("--profile", action="store_true",
                        help="then run the largest --num-jobs concurrently once more under "
                             "cProfile and torch.profiler (untimed): the device's busy time "
                             "against the wall, the top kernels and the top host functions")
    harness.add_out_argument(parser)
    args = parser.parse_args()
    if args.tiny:
        args.model, args.load_format = tiny_model_dir(), "auto"
        args.min_len, args.max_len = min(args.min_len, 8), min(args.max_len, 256)
        args.examples_per_job, args.batch_size = min(args.examples_per_job, 8), 4
        args.max_num_batched_tokens = min(args.max_num_batched_tokens, 512)

    from flexserve import LLM

    cuda = torch.cuda.is_available()
    options = {"max_num_batched_tokens": args.max_num_batched_tokens,
               "max_lora_rank": args.max_lora_rank or args.rank,
               "max_finetune_loras": args.max_finetune_loras,
               "job_memory_gib": args.finetune_job_memory_gib,
               "packing_time_limit_s": args.finetune_packing_time_limit,
               "batched_backward": args.batched_backward,
               "max_model_len": args.max_len + 16, "slo_tpot_ms": None}
    if cuda:
        options.update(dtype="bfloat16", gpu_memory_utilization=args.gpu_memory_utilization)
    llm = LLM(args.model, load_format=args.load_format, enable_lora=True, **options)
    engine = llm.engine
    vocab = engine.info.vocab_size
    capacity = engine.finetune_capacity
    print(f"fine-tuning capacity: {capacity.describe()}", flush=True)
    writer = harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True))
    warmup = make_job(10_000, args, vocab)
    first = run(engine, [warmup], concurrent=False)  # kernel compiles, allocator
    # Its start includes the captures its plan needs on CUDA (none where the engine's start-up
    # warmed that plan): the pause a server's requests see when such a job is submitted.
    writer.write({"model": "tiny" if args.tiny else args.model, "mode": "first job",
                  "rank": args.rank, "start_seconds": round(first["start_seconds"], 3),
                  "seconds": round(first["seconds"], 3)})
    for num_jobs in args.num_jobs:
        jobs = [make_job(i, args, vocab) for i in range(num_jobs)]
        results = {}
        for mode in args.modes:
            result = run(engine, jobs, concurrent=mode == "concurrent")
            results[mode] = result
            peak = result["peak_extra_bytes"]
            writer.write({
                "model": "tiny" if args.tiny else args.model, "num_jobs": num_jobs, "mode": mode,
                "rank": args.rank, "examples_per_job": args.examples_per_job,
                "batch_size": args.batch_size, "lengths": f"pareto({args.alpha}) "
                f"{args.min_len}..{args.max_len}", "tokens": result["tokens"],
                "seconds": round(result["seconds"], 3),
                "tokens_per_s": round(result["tokens"] / result["seconds"], 1),
                # the jobs' starts (graph captures on CUDA) and the rest, training
                "start_seconds": round(result["start_seconds"], 3),
                "training_tokens_per_s": round(result["tokens"] / max(
                    result["seconds"] - result["start_seconds"], 1e-9), 1),
                "peak_extra_memory_gb": None if peak is None else round(peak / 1e9, 3),
                "max_jobs_at_once": result["max_running"],
                "packing_rounds": result["packing_rounds"],
                # layer-windows of the backward: run as graphs / eagerly, run together with
                # others of their layer, and of those, together with other jobs' windows
                "backward_windows": result["backward_windows"]})
        if len(results) == 2:
            concurrent, sequential = results["concurrent"], results["sequential"]
            writer.write({"num_jobs": num_jobs, "speedup_concurrent_vs_sequential": round(
                sequential["seconds"] / concurrent["seconds"], 3)})
    if args.profile:
        jobs = [make_job(i, args, vocab) for i in range(max(args.num_jobs))]
        profile_run(engine, jobs)


def profile_run(engine, jobs: list, top: int = 30) -> None:
    """The jobs concurrently under cProfile and (on CUDA) torch.profiler's kernel times
    (`harness.kernel_times`); prints where the time goes."""
    import cProfile
    import io
    import pstats

    results = []
    host = cProfile.Profile()
    host.enable()
    if torch.cuda.is_available():
        kernels = harness.kernel_times(lambda: results.append(run(engine, jobs, True)), iters=1)
    else:  # no device kernels
        kernels = {}
        results.append(run(engine, jobs, concurrent=True))
    host.disable()
    result = results[0]
    busy = sum(k.us for k in kernels.values()) / 1e6
    print(f"profiled run: {result['seconds']:.2f} s wall ({result['start_seconds']:.2f} s "
          f"starting jobs), device busy {busy:.2f} s; backward windows "
          f"{result['backward_windows']}")
    for name, k in sorted(kernels.items(), key=lambda item: -item[1].us)[:top]:
        print(f"  {k.us / 1e6:8.3f} s  {k.launches:7.0f}x  {name[:100]}")
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats(order).print_stats(top)
        print(text.getvalue())


if __name__ == "__main__":
    main()

"""Host (Python) milliseconds that fine-tuning forward windows add to an iteration, on the CPU
(and, with --model on a GPU, what they cost next to the device's own time).

A tiny random Llama (default 32 layers, hidden 128: the layer count of Llama-3.1-8B, so the
per-layer and per-linear Python costs add up as they do on the GPU, with little compute) runs on
the CPU behind `LLM(..., enable_lora=True)`. Hand-built `BatchPlan`s go straight
to the model runner (`executor.execute`), as the profiler's do, so every case has exactly its
shape. Per LoRA setting (a job training down_proj only, and one training all 7 targets):

(a) decode: `--decode-rows` decode rows only (inference_mode, no capture);
(p) prefill N: the decode rows plus an inference prefill chunk of N tokens at the window's
    positions (base model, not sampled): the window's compute without fine-tuning's work;
(b) window N: the decode rows plus one fine-tuning forward window of N tokens (the capture,
    the LoRA shrinks of the job's slot, the window's loss); `extra` = (b) - (a) is what the
    latency model sees for an iteration with a window, `ft` = (b) - (p) what fine-tuning adds
    to the same tokens as inference: the host overhead of the capture path, with little compute
    (rank-16 LoRA, the activation copies and a 256-vocab loss);
(c) backward N: the decode rows plus one backward window of N tokens of one layer.

Each case's time is the median over `--repeats` iterations (decode and window iterations are
interleaved, so drift hits both). Times are the process's CPU time (`time.process_time`): with
OMP_NUM_THREADS=1 that is the wall time of an unpreempted run, and other processes on a shared
machine barely move it; `--clock wall` uses perf_counter. `fwd` and `loss` split a window
iteration into the model forward and `FinetuneRunner.window_losses`; `faults` counts the minor
page faults of a window iteration (first writes to fresh memory: kernel time a GPU never pays).
`--profile` prints the top functions of a cProfile of window iterations (a separate, untimed
pass). A sequence has `--windows-per-sequence` windows: the medians are of steady windows, the
one starting a sequence (its activation store, its backward state) is one in that many.

    OMP_NUM_THREADS=1 python benchmarks/finetune_host_overhead.py [--window-tokens 64 256] \
        [--decode-rows 4] [--repeats 30] [--profile]

On a GPU, `--model llama-3.1-8b` (dummy bf16 weights, wall clock) runs the real architecture;
`--gpu-time` adds the `gpu` column: the CUDA kernel time of one window iteration (torch.profiler,
median of 5), so `window` - `gpu` is the time the device waits for the host:

    python benchmarks/finetune_host_overhead.py --model llama-3.1-8b --clock wall --gpu-time \
        --window-tokens 16 64 256 1024 --decode-rows 16 --decode-context 512
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import itertools
import os
import pstats
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

JOB_ID = "host-overhead"
TARGET_SETS = {"down_proj": ["down_proj"],
               "all7": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]}


def tiny_model_dir(num_layers: int, hidden_size: int, max_len: int) -> str:
    """A tiny random Llama checkpoint (a 256-token vocabulary) saved with HF's own class."""
    from transformers import AutoModelForCausalLM

    config = harness.tiny_llama_config(vocab_size=256, hidden_size=hidden_size, num_layers=num_layers,
                                       max_len=max_len)
    path = tempfile.mkdtemp(prefix="flexserve-ft-host-")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


class Timed:
    """Wraps a callable and sums the clock time of its calls."""

    def __init__(self, fn: Callable, clock: Callable[[], float]) -> None:
        self.fn, self.clock, self.seconds = fn, clock, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = self.clock()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += self.clock() - start


class Bench:
    """Plans for one executor: fixed decode rows, fine-tuning sequences with fresh ids."""

    def __init__(self, executor: Any, decode_rows: int, decode_context: int,
                 clock: Callable[[], float]) -> None:
        from flexserve.engine.plan import ScheduledSequence
        from flexserve.sampling_params import SamplingParams

        self.executor = executor
        self.clock = clock
        self.block_size = executor.block_size
        self.num_layers = executor.hf_config.num_hidden_layers
        self.vocab_size = executor.hf_config.vocab_size
        self.sequence_ids = itertools.count()
        self.next_block = 0
        params = SamplingParams(temperature=0.0)
        self.rows = []
        for i in range(decode_rows):
            self.rows.append(ScheduledSequence(
                request_id=f"decode-{i}", new_token_ids=[7 + i],
                num_computed_tokens=decode_context - 1, block_ids=self._blocks(decode_context),
                needs_sample=True, sampling_params=params, prompt_token_ids=[7 + i],
                output_token_ids=[], eos_token_id=None, seed=None))
        self.prefill_blocks: list[int] = []  # the prefill row's (set by `reserve_prefill`)
        self.first_finetune_block = self.next_block

    def reserve_prefill(self, max_tokens: int) -> None:
        """Blocks for the prefill row of (p), before the fine-tuning sequences' blocks."""
        self.prefill_blocks = self._blocks(max_tokens)
        self.first_finetune_block = self.next_block

    def _blocks(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // self.block_size)
        first, self.next_block = self.next_block, self.next_block + count
        return list(range(first, first + count))

    def run(self, plan: Any) -> float:
        start = self.clock()
        result = self.executor.execute(plan)
        seconds = self.clock() - start
        if result.finetune_errors:
            raise RuntimeError(f"the fine-tuning job failed: {result.finetune_errors}")
        return seconds

    def decode_plan(self) -> Any:
        from flexserve.engine.plan import BatchPlan

        return BatchPlan(sequences=self.rows)

    def sequence(self, num_tokens: int) -> Any:
        """A new fine-tuning sequence's start (its blocks follow the decode rows' blocks)."""
        from flexserve.engine.plan import FinetuneSequenceStart

        num_blocks = -(-num_tokens // self.block_size)
        first = self.first_finetune_block
        token_ids = [(13 * p + 5) % self.vocab_size for p in range(num_tokens)]
        return FinetuneSequenceStart(JOB_ID, next(self.sequence_ids), token_ids,
                                     [False] + [True] * (num_tokens - 1), 1.0 / (num_tokens - 1),
                                     list(range(first, first + num_blocks)))

    def forward_plans(self, start: Any, window_tokens: int) -> list[Any]:
        """One plan per forward window of the sequence, the decode rows riding in each."""
        from flexserve.engine.plan import BatchPlan, FinetuneWindow

        plans = []
        for begin in range(0, len(start.token_ids), window_tokens):
            end = min(len(start.token_ids), begin + window_tokens)
            plan = BatchPlan(sequences=self.rows, finetune_windows=[
                FinetuneWindow(JOB_ID, start.sequence_id, begin, end, 0)])
            if begin == 0:
                plan.finetune_starts.append(start)
            plans.append(plan)
        return plans

    def prefill_plan(self, window_plan: Any) -> Any:
        """The decode rows plus an inference prefill chunk at the positions of the plan's window."""
        from flexserve.engine.plan import BatchPlan, ScheduledSequence
        from flexserve.sampling_params import SamplingParams

        w = window_plan.finetune_windows[0]
        tokens = [(13 * p + 5) % self.vocab_size for p in range(w.start, w.end)]
        row = ScheduledSequence(
            request_id="prefill", new_token_ids=tokens, num_computed_tokens=w.start,
            block_ids=self.prefill_blocks[:-(-w.end // self.block_size)], needs_sample=False,
            sampling_params=SamplingParams(), prompt_token_ids=tokens, output_token_ids=[],
            eos_token_id=None, seed=None)
        return BatchPlan(sequences=self.rows + [row])

    def backward_plans(self, start: Any, window_tokens: int) -> list[Any]:
        """One plan per backward window (layers from the top, windows from the end)."""
        from flexserve.engine.plan import BackwardWindow, BatchPlan

        n = len(start.token_ids)
        return [BatchPlan(sequences=self.rows, backward_windows=[
                    BackwardWindow(JOB_ID, start.sequence_id, layer, max(0, end - window_tokens),
                                   end)])
                for layer in range(self.num_layers - 1, -1, -1)
                for end in range(n, 0, -window_tokens)]

    def drop(self, start: Any) -> None:
        """Free the sequence's state (directly: a plan with nothing but finished sequences is
        not fine-tuning work to `ModelRunner.execute`, which would skip it)."""
        self.executor.finetune_runner.finish_sequences([(JOB_ID, start.sequence_id)])


def kernel_seconds(run: Callable[[], Any]) -> float:
    """The summed CUDA kernel time of one `run()` (torch.profiler)."""
    return sum(t.us for t in harness.kernel_times(run, iters=1).values()) / 1e6


def measure(bench: Bench, window_tokens: int, windows_per_sequence: int, repeats: int,
            backward_repeats: int, profile: cProfile.Profile | None,
            gpu_time: bool = False) -> dict[str, float]:
    """Median seconds of the decode, window and backward iterations, and the window's split."""
    runner = bench.executor._finetune()
    model = bench.executor.model
    forward = Timed(model.forward, bench.clock)
    losses = Timed(runner.window_losses, bench.clock)
    decode, prefill, window, fwd, loss, faults = [], [], [], [], [], []
    model.forward, runner.window_losses = forward, losses
    try:
        warm = 3
        while len(window) < repeats + warm:
            start = bench.sequence(window_tokens * windows_per_sequence)
            for plan in bench.forward_plans(start, window_tokens):
                decode.append(bench.run(bench.decode_plan()))
                prefill.append(bench.run(bench.prefill_plan(plan)))
                forward.seconds = losses.seconds = 0.0
                if profile is not None and len(window) >= warm:
                    profile.enable()
                first_fault = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                window.append(bench.run(plan))
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - first_fault)
                if profile is not None:
                    profile.disable()
                fwd.append(forward.seconds)
                loss.append(losses.seconds)
            bench.drop(start)
        gpu = []
        for _ in range(5 if gpu_time else 0):  # the second window of a sequence, a steady one
            start = bench.sequence(window_tokens * windows_per_sequence)
            plans = bench.forward_plans(start, window_tokens)
            bench.run(plans[0])
            gpu.append(kernel_seconds(functools.partial(bench.run, plans[1])))
            bench.drop(start)
        backward = []
        if backward_repeats > 0:
            start = bench.sequence(window_tokens * windows_per_sequence)
            for plan in bench.forward_plans(start, window_tokens):
                bench.run(plan)
            backward = [bench.run(plan) for plan in
                        bench.backward_plans(start, window_tokens)[:backward_repeats + warm]]
            bench.drop(start)
    finally:
        del model.forward, runner.window_losses
    med = lambda xs: statistics.median(xs[warm:]) if xs[warm:] else float("nan")  # noqa: E731
    return {"decode": med(decode), "prefill": med(prefill), "window": med(window),
            "fwd": med(fwd), "loss": med(loss), "backward": med(backward), "faults": med(faults),
            "gpu": statistics.median(gpu) if gpu else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--window-tokens", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--windows-per-sequence", type=int, default=4)
    parser.add_argument("--decode-rows", type=int, default=4)
    parser.add_argument("--decode-context", type=int, default=128)
    parser.add_argument("--targets", nargs="+", default=list(TARGET_SETS), choices=TARGET_SETS)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--backward-repeats", type=int, default=30)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--profile", action="store_true", help="cProfile the window iterations")
    parser.add_argument("--profile-lines", type=int, default=30)
    parser.add_argument("--model", default=None,
                        help="a shipped architecture (llama-3.1-8b) with dummy bf16 weights on "
                             "the GPU, instead of the tiny CPU model")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs: every iteration runs eagerly (GPU only)")
    parser.add_argument("--gpu-time", action="store_true",
                        help="also the CUDA kernel time of a window iteration (GPU only)")
    args = parser.parse_args()
    if args.gpu_time and not (args.model and torch.cuda.is_available()):
        parser.error("--gpu-time needs --model and a GPU")
    if args.clock == "cpu" and os.environ.get("OMP_NUM_THREADS") != "1":
        print("warning: set OMP_NUM_THREADS=1 (torch's threads distort host times)",
              file=sys.stderr)
    torch.set_num_threads(1)
    from flexserve import LLM
    from flexserve.finetune.hyperparameters import Hyperparameters, LoRAHyperparameters

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    max_len = args.windows_per_sequence * max(args.window_tokens) + args.decode_context
    max_batched = max(max(args.window_tokens) + args.decode_rows + 64, 256)
    if args.model:
        llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", enable_lora=True,
                  max_lora_rank=max(16, args.rank), max_model_len=max_len,
                  max_num_batched_tokens=max_batched, gpu_memory_utilization=0.6,
                  enforce_eager=args.enforce_eager)
    else:
        path = tiny_model_dir(args.num_layers, args.hidden_size, max_len)
        llm = LLM(model=path, enable_lora=True, max_lora_rank=max(16, args.rank),
                  max_model_len=max_len, max_num_batched_tokens=max_batched,
                  num_blocks=3 * max_len // 16 + args.decode_rows * (args.decode_context // 16 + 1)
                  + 16, device="cpu", dtype="float32")
    executor = llm.engine.executor
    bench = Bench(executor, args.decode_rows, args.decode_context, clock)
    bench.reserve_prefill(args.windows_per_sequence * max(args.window_tokens))
    config = executor.hf_config
    print(f"{args.model or 'tiny'}: {config.num_hidden_layers} layers, hidden "
          f"{config.hidden_size}, {args.decode_rows} decode rows "
          f"(context {args.decode_context}), rank {args.rank}, dropout {args.dropout}, "
          f"{args.clock} ms, median of {args.repeats}")
    header = (f"{'targets':<10} {'N':>5} {'decode':>8} {'prefill':>8} {'window':>8} {'extra':>8} "
              f"{'ft':>8} {'fwd':>8} {'loss':>7} {'backward':>9} {'faults':>7} {'gpu':>7}")
    print(header)
    print("-" * len(header))
    profile = cProfile.Profile() if args.profile else None
    for targets in args.targets:
        executor.add_finetune_job(
            job_id=JOB_ID, lora_slot=0, hyperparameters=Hyperparameters(lora=LoRAHyperparameters(
                r=args.rank, alpha=2.0 * args.rank, dropout=args.dropout,
                target_modules=TARGET_SETS[targets])),
            num_training_steps=1, init_adapter_path=None, seed=0)
        try:
            for n in args.window_tokens:
                r = measure(bench, n, args.windows_per_sequence, args.repeats,
                            args.backward_repeats, None, args.gpu_time)
                if profile is not None:  # a pass of its own: the profiler slows what it sees
                    measure(bench, n, args.windows_per_sequence, args.repeats, 0, profile)
                ms = {k: 1e3 * v for k, v in r.items()}
                print(f"{targets:<10} {n:>5} {ms['decode']:>8.2f} {ms['prefill']:>8.2f} "
                      f"{ms['window']:>8.2f} {ms['window'] - ms['decode']:>8.2f} "
                      f"{ms['window'] - ms['prefill']:>8.2f} {ms['fwd']:>8.2f} {ms['loss']:>7.2f} "
                      f"{ms['backward']:>9.2f} {r['faults']:>7.0f} {ms['gpu']:>7.2f}", flush=True)
        finally:
            executor.remove_finetune_job(JOB_ID)
    if profile is not None:
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        stats.sort_stats("tottime").print_stats(args.profile_lines)
        stats.sort_stats("cumulative").print_stats(args.profile_lines)
        print(out.getvalue())


if __name__ == "__main__":
    main()

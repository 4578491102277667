"""Host (Python) milliseconds per decode step, with a model so small that its forward barely counts.

A 2-layer, hidden-64 Llama with random weights and the default model's tokenizer (SmolLM2, so
detokenization costs what it costs with a real tokenizer; the logits cover its first
--vocab-size ids) runs on the CPU. Two measurements per
batch size:

(a) `LLMEngine.step()` alone in steady decode (every request prefilled, one token per row);
(b) `LLM.generate` end to end, per generated token: (time of a generate with --output-len tokens
    minus one with a single token) / (output_len - 1), the TPOT that `offline_throughput.py`
    reports.

The model's own compute (the forward, the lm_head and the sampler's tensor ops) is timed by hooks
and reported as `device_ms`; `host_ms` = step - device is what a GPU would not hide. Times are
CPU time of the process (`time.process_time`), so other load on the machine matters little; run
with OMP_NUM_THREADS=1. Steps are means (a periodic cost, e.g. a latency-model refit, counts).

    OMP_NUM_THREADS=1 python benchmarks/host_overhead.py --batch-sizes 1 32 64 [--profile] \
        [--out]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

# CPU time of this process, not wall time: other processes on a shared machine then barely move
# the numbers (with one torch thread, CPU time is the wall time of an unpreempted run).
clock = time.process_time


def tiny_model_dir(vocab_size: int, num_layers: int, hidden_size: int, max_len: int) -> str:
    """A directory with only a config.json (weights come from load_format="dummy")."""
    config = harness.tiny_llama_config(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                                       max_len=max_len)
    path = tempfile.mkdtemp(prefix="flexserve-host-overhead-")
    config.to_json_file(os.path.join(path, "config.json"))
    return path


class DeviceTimer:
    """Sums the wall time of the model's compute: forward, lm_head and the sampler."""

    def __init__(self, runner: Any) -> None:
        self.seconds = 0.0
        model, sampler = runner.model, runner.sampler
        for module in (model, sampler):
            module.register_forward_pre_hook(self._start)
            module.register_forward_hook(self._stop)
        compute_logits = model.compute_logits

        def timed_logits(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return compute_logits(*args, **kwargs)
            finally:
                self.seconds += clock() - t0

        model.compute_logits = timed_logits
        self._t0 = 0.0

    def _start(self, *_: Any) -> None:
        self._t0 = clock()

    def _stop(self, *_: Any) -> None:
        self.seconds += clock() - self._t0


def profiled(profiler: cProfile.Profile | None, fn: Callable[[], Any]) -> Any:
    if profiler is None:
        return fn()
    profiler.enable()
    try:
        return fn()
    finally:
        profiler.disable()


def measure_step(llm: Any, timer: DeviceTimer, batch: int, prompt_len: int, num_steps: int,
                 vocab_size: int, profiler: cProfile.Profile | None) -> dict:
    """(a): steady-state decode steps of `batch` requests."""
    from flexserve import SamplingParams

    engine = llm.engine
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(100, vocab_size - 100, (batch, prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 16, ignore_eos=True)
    ids = []
    for prompt in prompts:
        ids.append(engine.next_request_id())
        engine.add_request(ids[-1], prompt, params)
    while engine.scheduler.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()
    step_s, device_s = [], []
    for _ in tqdm(range(num_steps), desc=f"engine.step batch {batch}", leave=False):
        timer.seconds = 0.0
        t0 = clock()
        profiled(profiler, engine.step)
        step_s.append(clock() - t0)
        device_s.append(timer.seconds)
    engine.abort_request(ids)
    step_ms = sum(step_s) / len(step_s) * 1e3
    device_ms = sum(device_s) / len(device_s) * 1e3
    median_host_ms = harness.median([s - d for s, d in zip(step_s, device_s)]) * 1e3
    return {"what": "engine.step", "batch": batch, "step_ms": round(step_ms, 3),
            "device_ms": round(device_ms, 3), "host_ms": round(step_ms - device_ms, 3),
            "median_host_ms": round(median_host_ms, 3)}


def measure_generate(llm: Any, timer: DeviceTimer, batch: int, prompt_len: int,
                     output_len: int, vocab_size: int, repeats: int,
                     profiler: cProfile.Profile | None) -> dict:
    """(b): `LLM.generate` per generated token, minus the prefill (a one-token generate)."""
    from flexserve import SamplingParams

    g = torch.Generator().manual_seed(1000 + batch)
    prompts = torch.randint(100, vocab_size - 100, (batch, prompt_len), generator=g).tolist()
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], full, use_tqdm=False)  # warm-up

    def timed(params: SamplingParams, prof: cProfile.Profile | None) -> tuple[float, float]:
        timer.seconds = 0.0
        t0 = clock()
        outputs = profiled(prof, lambda: llm.generate(prompts, params, use_tqdm=False))
        elapsed = clock() - t0
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == batch * params.max_tokens
        return elapsed, timer.seconds

    per_token, per_token_device = [], []
    for _ in tqdm(range(repeats), desc=f"LLM.generate batch {batch}", leave=False):
        prefill_s, prefill_device_s = timed(one, None)
        total_s, total_device_s = timed(full, profiler)
        per_token.append((total_s - prefill_s) / (output_len - 1))
        per_token_device.append((total_device_s - prefill_device_s) / (output_len - 1))
    step_ms = harness.median(per_token) * 1e3
    device_ms = harness.median(per_token_device) * 1e3
    return {"what": "LLM.generate", "batch": batch, "step_ms": round(step_ms, 3),
            "device_ms": round(device_ms, 3), "host_ms": round(step_ms - device_ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64, help="tokens per generate (b)")
    parser.add_argument("--steps", type=int, default=64, help="timed engine steps (a)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate calls (b)")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="logits width (the first ids of the tokenizer's vocabulary): small, "
                        "so the lm_head and the argmax stay cheap on the CPU")
    parser.add_argument("--no-tokenizer", action="store_true",
                        help="token ids only (like the shipped benchmark configs)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile top-N")
    parser.add_argument("--top", type=int, default=40, help="rows of the cProfile table")
    harness.add_out_argument(parser)
    args = parser.parse_args()

    from flexserve import LLM
    from flexserve.model import default_model

    tokenizer_dir = None if args.no_tokenizer else default_model.materialize()
    vocab_size = args.vocab_size
    max_len = args.prompt_len + max(args.output_len, args.steps) + 64
    model_dir = tiny_model_dir(vocab_size, args.num_layers, args.hidden_size, max_len)
    llm = LLM(model_dir, load_format="dummy", dtype="float32", device="cpu",
              tokenizer=tokenizer_dir, max_model_len=max_len,
              max_num_seqs=max(args.batch_sizes),
              max_num_batched_tokens=max(2048, max(args.batch_sizes) * args.prompt_len),
              enable_prefix_caching=False)
    timer = DeviceTimer(llm.engine.core.executor)
    step_profiler = cProfile.Profile() if args.profile else None
    generate_profiler = cProfile.Profile() if args.profile else None
    writer = harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True))
    for batch in tqdm(args.batch_sizes, desc="batch sizes"):
        for row in (
            measure_step(llm, timer, batch, args.prompt_len, args.steps, vocab_size,
                         step_profiler),
            measure_generate(llm, timer, batch, args.prompt_len, args.output_len, vocab_size,
                             args.repeats, generate_profiler),
        ):
            row.update(tokenizer=tokenizer_dir is not None, torch_threads=torch.get_num_threads())
            writer.write(row)
    for name, profiler in (("engine.step", step_profiler), ("LLM.generate", generate_profiler)):
        if profiler is None:
            continue
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(args.top)
        print(f"\n===== cProfile of {name} (all batch sizes), by cumulative time =====")
        print(stream.getvalue())


if __name__ == "__main__":
    main()

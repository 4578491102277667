"""Where a decode step's time goes: device time of the captured forward, lm_head + sampling,
and the host's share (schedule, metadata, output processing), per batch size.

    python benchmarks/decode_step_profile.py --model llama-3.1-8b --load-format dummy \
        --batch-sizes 1 32 [--cprofile] [--out]

Device times come from CUDA events around the graph replay (the forward alone) and around a
whole `ModelRunner.execute`; the step's wall time from `LLMEngine.step`. --cprofile prints the
host functions that take the most time over the timed steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402


def build_llm(model: str, load_format: str, max_model_len: int, max_num_seqs: int,
              enforce_eager: bool = False):
    """The offline `LLM` these profiles run on: bf16, no prefix caching (every prompt is
    prefilled), CUDA graphs unless enforce_eager."""
    from flexserve import LLM

    return LLM(model, load_format=load_format, dtype="bfloat16", max_model_len=max_model_len,
               max_num_seqs=max_num_seqs, gpu_memory_utilization=0.85,
               enforce_eager=enforce_eager, enable_prefix_caching=False)


def start_decode(engine, batch: int, input_len: int, max_tokens: int,
                 num_warmup_steps: int = 4) -> None:
    """Adds `batch` random greedy prompts of `input_len` tokens, prefills them and runs
    `num_warmup_steps` decode steps, so the next `engine.step()` is a steady decode step."""
    from flexserve import SamplingParams

    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(100, engine.info.vocab_size - 100, (batch, input_len), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(engine.next_request_id(), p, params)
    while engine.scheduler.num_waiting:  # prefill
        engine.step()
    for _ in range(num_warmup_steps):
        engine.step()
    torch.cuda.synchronize()


def finish_requests(engine) -> None:
    """Aborts every request and steps the engine until it holds none."""
    engine.abort_request(list(engine.scheduler.requests))
    while engine.has_unfinished_requests():
        engine.step()


def decode_graph(runner, batch: int):
    """The captured decode forward (without LoRA) that a step of `batch` rows replays, or None
    when the runner has no graphs (--enforce-eager). Its static inputs hold the last step's."""
    if runner.graph_runner is None:
        return None
    from flexserve.worker.cuda_graphs import padded_batch_size

    key = (padded_batch_size(batch, runner.graph_runner.batch_sizes), False)
    return runner.graph_runner.graphs[key]


def graph_replay_ms(graph, reps: int = 20) -> float:
    """Median device time of one `graph.replay()`."""
    return harness.time_ms(graph.replay, iters=reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true")
    harness.add_out_argument(parser)
    args = parser.parse_args()
    writer = harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True))

    llm = build_llm(args.model, args.load_format, args.input_len + args.steps + 64,
                    max(args.batch_sizes), args.enforce_eager)
    engine = llm.engine
    runner = engine.core.executor
    for batch in args.batch_sizes:
        start_decode(engine, batch, args.input_len, args.steps + 16)
        # 1. the whole engine step, wall clock
        profiler = cProfile.Profile() if args.cprofile else None
        walls = []
        for _ in range(args.steps // 2):
            t0 = time.perf_counter()
            if profiler:
                profiler.enable()
            engine.step()
            if profiler:
                profiler.disable()
            walls.append(time.perf_counter() - t0)
        # 2. device time of the forward alone (graph replay) and of lm_head + sampling inputs
        graph = decode_graph(runner, batch)
        forward_ms = graph_replay_ms(graph) if graph is not None else None
        hidden = torch.randn(batch, runner.hf_config.hidden_size, device="cuda",
                             dtype=torch.bfloat16)
        lm_head_ms = harness.time_ms(lambda hidden=hidden: runner.model.compute_logits(hidden).argmax(-1),
                                     iters=20)
        row = {"batch": batch, "step_wall_ms": round(harness.median(walls) * 1e3, 3),
               "forward_device_ms": forward_ms and round(forward_ms, 3),
               "lm_head_argmax_device_ms": round(lm_head_ms, 3)}
        writer.write(row)
        if profiler:
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(25)
        finish_requests(engine)


if __name__ == "__main__":
    main()

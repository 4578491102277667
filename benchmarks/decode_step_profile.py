"""Where a decode step's time goes: device time of the captured forward, lm_head + sampling,
and the host's share (schedule, metadata, output processing), per batch size.

    python benchmarks/decode_step_profile.py --model llama-3.1-8b --load-format dummy \
        --batch-sizes 1 32 [--cprofile]

Device times come from CUDA events around the graph replay (the forward alone) and around a
whole `ModelRunner.execute`; the step's wall time from `LLMEngine.step`. --cprofile prints the
host functions that take the most time over the timed steps.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import torch


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()

    from flexserve import LLM, SamplingParams

    llm = LLM(args.model, load_format=args.load_format, dtype="bfloat16",
              max_model_len=args.input_len + args.steps + 64, max_num_seqs=max(args.batch_sizes),
              gpu_memory_utilization=0.85, enforce_eager=args.enforce_eager,
              enable_prefix_caching=False)
    engine = llm.engine
    runner = engine.core.executor
    vocab = engine.info.vocab_size
    for batch in args.batch_sizes:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(100, vocab - 100, (batch, args.input_len), generator=g).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 16, ignore_eos=True)
        for p in prompts:
            engine.add_request(engine.next_request_id(), p, params)
        while engine.scheduler.num_waiting:  # prefill
            engine.step()
        for _ in range(4):  # warm-up decode steps
            engine.step()
        torch.cuda.synchronize()
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
        forward_ms = None
        if runner.graph_runner is not None:
            from flexserve.worker.cuda_graphs import padded_batch_size

            key = (padded_batch_size(batch, runner.graph_runner.batch_sizes), False)
            graph = runner.graph_runner.graphs[key]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(20):
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            forward_ms = median(times)
        hidden = torch.randn(batch, runner.hf_config.hidden_size, device="cuda",
                             dtype=torch.bfloat16)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            logits = runner.model.compute_logits(hidden)
            logits.argmax(-1)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        row = {"batch": batch, "step_wall_ms": round(median(walls) * 1e3, 3),
               "forward_device_ms": forward_ms and round(forward_ms, 3),
               "lm_head_argmax_device_ms": round(median(times), 3)}
        print(json.dumps(row), flush=True)
        if profiler:
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(25)
        engine.abort_request(list(engine.scheduler.requests))
        while engine.has_unfinished_requests():
            engine.step()


if __name__ == "__main__":
    main()

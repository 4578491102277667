"""Fine-tuning iterations under the TPOT SLO, one by one: measured against the latency model, and
where the slow ones spend their time.

    python benchmarks/finetune_iteration_stalls.py --latency-profile PROFILE.json \
        [--allow-cudnn-sdpa] [--out]

An offline `LLM` (dummy weights, `slo_tpot_ms` 50, the given latency profile) runs a LoRA r=16
down_proj job alone for --duration seconds on sequences of 1024-8192 random tokens, so windows are
sized by the latency model as under `flexserve serve`. Every iteration's shape, predicted and
measured time are recorded with `finetune_throughput.install_timers`' synchronizing timers
around the parts of the fine-tuning step (forward/backward step, attention backward and its
forward recompute, rematerialization, window loss, sequence start, optimizer),
the allocator's cudaMalloc/cudaFree/retry counts and garbage-collection time. It prints the
iterations over --stall-ratio x their (uncorrected) prediction with their breakdown, and a
summary line (tokens/s, iteration-time percentiles, stalls). The timers synchronize, so absolute
throughput is below an untimed run's. `--allow-cudnn-sdpa` lets the backward window attention
use cuDNN again (it is excluded because of its per-shape plan builds; docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def install_gc_timer(totals: dict[str, float]) -> None:
    """Garbage-collection pauses, summed into `totals["gc"]`."""
    began = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            totals["gc"] = totals.get("gc", 0.0) + time.perf_counter() - began[0]
    gc.callbacks.append(on_gc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--latency-profile", default=None,
                        help="a `flexserve profile` JSON [the state directory's match, else the fallback]")
    parser.add_argument("--duration", type=float, default=45.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    parser.add_argument("--stall-ratio", type=float, default=2.5)
    parser.add_argument("--allow-cudnn-sdpa", action="store_true")
    parser.add_argument("--length-scale", type=float, default=1.0,
                        help="scale the 1024-8192 sequence lengths (CPU smoke runs)")
    harness.add_out_argument(parser)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()  # the CPU runs it only as a smoke test

    from torch.nn.attention import SDPBackend

    from flexserve import LLM
    from flexserve.engine import iteration_shape, online_latency_model
    from flexserve.finetune.data import TrainingData, TrainingExample
    from flexserve.finetune.hyperparameters import Hyperparameters
    from flexserve.worker.finetune import backward_ops

    if args.allow_cudnn_sdpa:
        backward_ops.WINDOW_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION,
                                             *backward_ops.WINDOW_SDPA_BACKENDS]
    from benchmarks.finetune_throughput import install_timers

    current = install_timers()
    install_gc_timer(current)
    records: list[dict] = []
    observe = online_latency_model.OnlineLatencyModel.observe
    counts = [dict.fromkeys(ALLOCATOR, 0)]

    def recording_observe(self, shape, seconds):
        predicted = self.predict(shape) / self.scale  # uncorrected
        observe(self, shape, seconds)
        stats = torch.cuda.memory_stats() if cuda else {}
        now = {k: stats.get(k, 0) for k in ALLOCATOR}
        records.append({"shape": {f: getattr(shape, f) for f in iteration_shape._SHAPE_FIELDS
                                  if getattr(shape, f)},
                        "predicted_ms": round(1e3 * predicted, 2),
                        "measured_ms": round(1e3 * seconds, 2),
                        "parts_ms": {k: round(1e3 * v, 2) for k, v in current.items()},
                        "allocator": {k: now[k] - counts[0][k] for k in ALLOCATOR}})
        counts[0] = now
        current.clear()
    online_latency_model.OnlineLatencyModel.observe = recording_observe

    llm = LLM(args.model, load_format="dummy", dtype="bfloat16" if cuda else "float32",
              max_model_len=8192,
              max_finetune_len=8192, enable_lora=True, max_lora_rank=16,
              gpu_memory_utilization=0.6, slo_tpot_ms=args.slo_tpot_ms,
              latency_profile=args.latency_profile)
    engine = llm.engine
    vocab = engine.info.vocab_size
    g = torch.Generator().manual_seed(0)
    lengths = [max(int(n * args.length_scale), 2)
               for n in [1024, 8192, 4096, 2048, 6144, 3072, 8192, 1024] * 8]
    examples = [TrainingExample(i + 1, torch.randint(100, vocab - 100, (n,), generator=g).tolist(),
                                [False] + [True] * (n - 1)) for i, n in enumerate(lengths)]
    data = TrainingData("text", examples, [], sum(lengths), sum(lengths) - len(lengths))
    hp = Hyperparameters.from_dict({"batch_size": 1, "n_epochs": 1, "shuffle": False,
                                    "max_seq_len": 8192, "lora": {"r": 16, "alpha": 32,
                                                                  "target_modules": ["down_proj"]}})
    job = engine.add_finetune_job(data, hp)
    began = last_print = time.perf_counter()
    while time.perf_counter() - began < args.duration and not job.finished:
        engine.step()
        if time.perf_counter() - last_print > 10:
            last_print = time.perf_counter()
            print(f"{last_print - began:5.1f} s: {len(records)} iterations", flush=True)
    timed = records[20:]  # past the kernel compiles of the first windows
    total_s = sum(r["measured_ms"] for r in timed) / 1e3
    stalls = [r for r in timed
              if r["predicted_ms"] and r["measured_ms"] > args.stall_ratio * r["predicted_ms"]]
    for r in stalls[:20]:
        print("slow:", json.dumps(r))
    times = sorted(r["measured_ms"] for r in timed)
    summary = {
        "model": args.model, "cudnn_sdpa": args.allow_cudnn_sdpa, "iterations": len(timed),
        "finetune_tokens_per_s": round(sum(r["shape"].get("finetune_tokens", 0)
                                           for r in timed) / total_s),
        "iteration_ms_p50_p90_p99_max": [times[int(q * len(times))] for q in (.5, .9, .99)]
        + [times[-1]],
        "slow_iterations": len(stalls),
        "seconds_in_slow_iterations": round(sum(r["measured_ms"] for r in stalls) / 1e3, 2),
        "seconds": round(total_s, 2),
    }
    harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True)).write(summary)


if __name__ == "__main__":
    main()

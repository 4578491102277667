"""Where the device time of a decode step goes, kernel by kernel, with the forward replayed from
its CUDA graph as in production; and how much of the step the device sits idle between kernels.

    python benchmarks/decode_kernel_profile.py --model llama-3.1-8b --load-format dummy \
        --batch-sizes 1 32 --input-len 512 --steps 20 [--out]

Per batch size: requests are prefilled and decoded a few steps, then two passes run under
`torch.profiler` (CUPTI records each kernel a graph replay launches):
- `graph`: `--steps` replays of the captured decoder forward alone, a synchronize after each (the
  static inputs hold the last real step's, so contexts are real);
- `step`: `--steps` whole `LLMEngine.step()`s (metadata copies, graph replay, lm_head, sampling).
A step is told apart by a `record_function` range around it (each step ends in a host sync, so
its kernels start inside its range). Per step: busy (union of kernel intervals), span (first
kernel start to last kernel end), idle = span - busy; a table by kernel group (all cuBLAS
GEMM/GEMV kernels in one bucket), the raw kernel names, and the idle gaps by which kernel groups
they sit between. `unprofiled_ms` is the CUDA-event time of the same work without the profiler
(for the step pass: around the whole `engine.step()`, host work included), to show what the
profiler adds. The step pass's span holds host work between its kernels (metadata copies before
the replay, sampling after), which the CPU-side recording of every torch op inflates; the graph
pass has none. The floor is `offline_throughput.floors` at the profiled context: every weight
(the graph pass leaves out lm_head) and each row's K/V read once at the copy bandwidth measured
here. Prints tables; appends one JSON line per (batch, pass) to --out. `--passes graph` runs the
graph pass only; `--cupti-warmup` is for stacks where profiling graphs captured before the first
profiler session fails (see its help).
"""

from __future__ import annotations

import argparse
import bisect
import re
import sys
import types
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

STEP_LABEL = "decode_kernel_profile.step"
# Substrings of a lower-cased kernel name -> its group; the first match wins (reduce before
# attention). cuBLAS picks nvjet_* (Hopper), sm90_xmma_*/cutlass_* or gemv* kernels by shape;
# one-row projections run flexserve's Triton _gemv_kernel (`flexserve.layers.linear`).
# Argmax: flexserve's two Triton kernels, or torch's reduce_kernel (outside the graph).
KERNEL_GROUPS = (
    ("rmsnorm", "RMSNorm (+residual)"),
    ("rope_kv_write", "rotary + KV-cache write"),
    ("rotary", "rotary"),
    ("kv_cache_write", "KV-cache write"),
    ("decode_attention_reduce", "decode attention reduce"),
    ("decode_attention", "decode attention (split-K)"),
    ("silu_and_mul", "SiLU-and-mul"),
    ("_gemv_kernel", "GEMV (Triton)"),
    ("argmax", "argmax (Triton)"),
    ("nvjet", "GEMM (cuBLAS)"),
    ("xmma", "GEMM (cuBLAS)"),
    ("cutlass", "GEMM (cuBLAS)"),
    ("gemv", "GEMM (cuBLAS)"),
    ("gemm", "GEMM (cuBLAS)"),
    ("splitkreduce", "GEMM (cuBLAS)"),
    ("memcpy", "memcpy"),
    ("memset", "memset"),
)


@dataclass(frozen=True)
class KernelRecord:
    """One device activity (kernel, memcpy, memset) from a profile."""

    name: str  # the kernel's name as the profiler reports it (demangled)
    start_us: float  # device start, microseconds on the profiler's clock
    end_us: float  # device end, same clock


def short_kernel_name(name: str) -> str:
    """A kernel name without `void `, template arguments, parameter list and the
    `(anonymous namespace)::` parts, so instantiations of one kernel read alike."""
    out, depth, prev = [], 0, ""
    for ch in name.strip():
        if ch in "<(":
            depth += 1
        elif ch in ">)" and depth and not (ch == ">" and prev == "-"):  # `->` closes nothing
            depth -= 1
        elif depth == 0:
            out.append(ch)
        prev = ch
    short = "".join(out).replace("::::", "::").strip()
    short = re.sub(r"^void\s+", "", short)
    # Older Triton appends a signature suffix (`_kernel_0d1d2de`) to the function name.
    short = re.sub(r"_0d(\d+d)*[ce]*$", "", short)
    return short or name.strip()


def kernel_group(name: str) -> str:
    """The bucket a kernel belongs to in the grouped table (see KERNEL_GROUPS)."""
    short = short_kernel_name(name)
    lowered = short.lower()  # template arguments could name anything: match the name only
    for needle, group in KERNEL_GROUPS:
        if needle in lowered:
            return group
    return short


def busy_us(records: list[KernelRecord]) -> float:
    """Length of the union of the records' intervals (overlapping kernels count once)."""
    total, cur_start, cur_end = 0.0, None, None
    for r in sorted(records, key=lambda r: (r.start_us, r.end_us)):
        if cur_end is None or r.start_us > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = r.start_us, r.end_us
        else:
            cur_end = max(cur_end, r.end_us)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def split_steps(records: list[KernelRecord], num_steps: int,
                step_starts_us: list[float] | None = None) -> tuple[list[list[KernelRecord]], int]:
    """Groups the records into `num_steps` steps; returns (steps, number of records left out).

    With step_starts_us (one per step, on the records' clock) a record belongs to the last step
    starting at or before it; records before the first start are left out. Without, the records
    are cut at their num_steps - 1 widest idle gaps (steps are separated by host work)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    ordered = sorted(records, key=lambda r: (r.start_us, r.end_us))
    steps: list[list[KernelRecord]] = [[] for _ in range(num_steps)]
    if step_starts_us is not None:
        if len(step_starts_us) != num_steps:
            raise ValueError(f"got {len(step_starts_us)} step starts for {num_steps} steps")
        starts = sorted(step_starts_us)
        num_left_out = 0
        for r in ordered:
            index = bisect.bisect_right(starts, r.start_us) - 1
            if index < 0:
                num_left_out += 1
            else:
                steps[index].append(r)
        return steps, num_left_out
    if len(ordered) < num_steps:
        raise ValueError(f"{len(ordered)} kernels cannot make {num_steps} steps")
    gaps, reach = [], ordered[0].end_us  # (gap, index of the first record after it)
    for i in range(1, len(ordered)):
        gaps.append((ordered[i].start_us - reach, i))
        reach = max(reach, ordered[i].end_us)
    cuts = sorted(i for _, i in sorted(gaps, key=lambda g: (-g[0], g[1]))[: num_steps - 1])
    bounds = [0, *cuts, len(ordered)]
    return [ordered[a:b] for a, b in zip(bounds, bounds[1:])], 0


def _table(totals: dict[str, list[float]], key: str, num_steps: int, busy_per_step: float) -> list[dict]:
    rows = []
    for name, (calls, total_us) in totals.items():
        us_per_step = total_us / num_steps
        rows.append({key: name, "calls_per_step": round(calls / num_steps, 3),
                     "us_per_call": round(total_us / calls, 3),
                     "us_per_step": round(us_per_step, 3),
                     "pct_of_busy": round(100 * us_per_step / busy_per_step, 2) if busy_per_step else 0.0})
    return sorted(rows, key=lambda row: (-row["us_per_step"], row[key]))


def summarize_kernels(records: list[KernelRecord], num_steps: int,
                      step_starts_us: list[float] | None = None) -> dict:
    """Per-step device time of a profile's kernels: busy, span, idle (means over steps and each
    step), a table by kernel group, one by raw kernel name, and one of the idle gaps by the
    groups of the kernels either side of them (`after -> before`). Times in microseconds."""
    steps, num_left_out = split_steps(records, num_steps, step_starts_us)
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    gaps: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    per_step = []
    for step in steps:
        step = sorted(step, key=lambda r: (r.start_us, r.end_us))
        for r in step:
            for totals, key in ((groups, kernel_group(r.name)), (names, r.name)):
                totals[key][0] += 1
                totals[key][1] += r.end_us - r.start_us
        reach = step[0].end_us if step else 0.0  # latest end so far: a gap is idle device time
        for prev, nxt in zip(step, step[1:]):
            if nxt.start_us > reach:
                key = f"{kernel_group(prev.name)} -> {kernel_group(nxt.name)}"
                gaps[key][0] += 1
                gaps[key][1] += nxt.start_us - reach
            reach = max(reach, nxt.end_us)
        span = reach - step[0].start_us if step else 0.0
        busy = busy_us(step)
        per_step.append({"num_kernels": len(step), "busy_us": round(busy, 3),
                         "span_us": round(span, 3), "idle_us": round(span - busy, 3)})
    mean_busy = sum(s["busy_us"] for s in per_step) / num_steps
    kernel_us = sum(total for _, total in groups.values()) / num_steps
    gap_rows = []
    for key, (count, total_us) in gaps.items():
        gap_rows.append({"between": key, "count_per_step": round(count / num_steps, 3),
                         "us_per_gap": round(total_us / count, 3),
                         "us_per_step": round(total_us / num_steps, 3)})
    gap_rows.sort(key=lambda row: (-row["us_per_step"], row["between"]))
    return {
        "num_steps": num_steps,
        "num_left_out": num_left_out,
        "kernels_per_step": round(sum(s["num_kernels"] for s in per_step) / num_steps, 3),
        "busy_us": round(mean_busy, 3),
        "span_us": round(sum(s["span_us"] for s in per_step) / num_steps, 3),
        "idle_us": round(sum(s["idle_us"] for s in per_step) / num_steps, 3),
        "kernel_us": round(kernel_us, 3),  # summed durations; > busy_us only if kernels overlap
        "steps": per_step,
        "groups": _table(groups, "group", num_steps, mean_busy),
        "kernels": _table(names, "name", num_steps, mean_busy),
        "gaps": gap_rows,
    }


def profiler_records(events, step_label: str = STEP_LABEL) -> tuple[list[KernelRecord], list[float]]:
    """Device activities and step starts from `prof.events()` (torch.autograd FunctionEvents).

    Reads only `name`, `device_type` and `time_range` (stable across torch 2.x; `device_time`
    vs `cuda_time` is not needed). The device-side mirrors of `record_function` ranges (Kineto's
    gpu_user_annotation) are dropped, so only kernels, memcpys and memsets remain."""
    from torch.autograd import DeviceType

    records, step_starts = [], []
    for evt in events:
        on_device = evt.device_type != DeviceType.CPU
        if evt.name == step_label:
            if not on_device:
                step_starts.append(float(evt.time_range.start))
            continue
        if not on_device or getattr(evt, "is_user_annotation", False) \
                or getattr(evt, "activity_type", None) == "gpu_user_annotation":
            continue
        records.append(KernelRecord(evt.name, float(evt.time_range.start), float(evt.time_range.end)))
    return records, sorted(step_starts)


def format_summary(summary: dict, title: str, floor_ms: float | None, unprofiled_ms: float | None,
                   num_rows: int = 15) -> str:
    """The printed report of one summary: headline, group table, raw top kernels, top gaps."""
    ms = lambda us: f"{us / 1e3:.3f} ms"  # noqa: E731
    head = (f"== {title}: busy {ms(summary['busy_us'])}, span {ms(summary['span_us'])}, "
            f"idle {ms(summary['idle_us'])} ({summary['kernels_per_step']:g} kernels/step)")
    if floor_ms is not None:
        head += f", floor {floor_ms:.3f} ms"
    if unprofiled_ms is not None:
        head += f", unprofiled {unprofiled_ms:.3f} ms"
    lines = [head, f"{'group':44} {'calls/step':>10} {'us/call':>9} {'us/step':>9} {'% busy':>7}"]
    for row in summary["groups"]:
        lines.append(f"{row['group'][:44]:44} {row['calls_per_step']:>10g} {row['us_per_call']:>9.2f} "
                     f"{row['us_per_step']:>9.1f} {row['pct_of_busy']:>7.1f}")
    lines.append(f"{'top kernels (raw names)':44} {'calls/step':>10} {'us/call':>9} {'us/step':>9} {'% busy':>7}")
    for row in summary["kernels"][:num_rows]:
        lines.append(f"{short_kernel_name(row['name'])[:44]:44} {row['calls_per_step']:>10g} "
                     f"{row['us_per_call']:>9.2f} {row['us_per_step']:>9.1f} {row['pct_of_busy']:>7.1f}")
    lines.append(f"{'idle gaps between (after -> before)':60} {'gaps/step':>9} {'us/gap':>8} {'us/step':>8}")
    for row in summary["gaps"][:num_rows]:
        lines.append(f"{row['between'][:60]:60} {row['count_per_step']:>9g} {row['us_per_gap']:>8.2f} "
                     f"{row['us_per_step']:>8.1f}")
    counts = [step["num_kernels"] for step in summary["steps"]]
    if min(counts) != max(counts):
        lines.append(f"(kernels per step vary from {min(counts)} to {max(counts)}: check the step split)")
    if summary["num_left_out"]:
        lines.append(f"({summary['num_left_out']} device activities before the first step left out)")
    return "\n".join(lines)


def _profile(work, num_steps: int, num_skip: int) -> dict:
    """Runs `work()` num_skip + num_steps times under the profiler, each in a step range, and
    summarizes the last num_steps (the first ones absorb CUPTI's start-up)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from tqdm.auto import tqdm

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in tqdm(range(num_skip + num_steps), desc="profiled steps", leave=False):
            with record_function(STEP_LABEL):
                work()
        torch.cuda.synchronize()
    records, starts = profiler_records(prof.events())
    if not records:
        raise RuntimeError("the profile holds no device activity: CUPTI recorded no kernels "
                           "(try again with or without --cupti-warmup)")
    if len(starts) != num_skip + num_steps:
        raise RuntimeError(f"found {len(starts)} '{STEP_LABEL}' ranges in the profile, "
                           f"expected {num_skip + num_steps}")
    first = starts[num_skip]
    return summarize_kernels([r for r in records if r.start_us >= first], num_steps, starts[num_skip:])


def step_device_ms(engine, num_steps: int) -> float:
    """Median time of one unprofiled `engine.step()` on the device clock (CUDA events around it:
    host work before its first kernel included, as in the step pass's span)."""
    return harness.time_ms(engine.step, iters=num_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: what the run needs + 64 (it sets decode attention's number of splits)")
    parser.add_argument("--passes", nargs="+", default=["graph", "step"], choices=["graph", "step"])
    parser.add_argument("--cupti-warmup", action="store_true",
                        help="open an empty CUDA profiler session before the graphs are captured "
                             "(the workaround of pytorch/pytorch#75504 for stacks where profiling "
                             "graphs captured earlier fails; on others it stops kernel collection)")
    harness.add_out_argument(parser)
    args = parser.parse_args()
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")

    import torch
    from tqdm.auto import tqdm

    from benchmarks import decode_step_profile as setup
    from benchmarks import offline_throughput as offline

    peaks = offline.measure_peaks(torch.device("cuda"))  # before the KV cache takes the memory
    if args.cupti_warmup:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            pass
    num_warmup, num_skip = 4, 2
    # Decode steps the engine takes after prefill: warm-up, then per step pass the skipped and
    # profiled steps and as many unprofiled ones.
    num_decode = num_warmup + 2 * (num_skip + args.steps)
    max_model_len = args.max_model_len or args.input_len + num_decode + 64
    llm = setup.build_llm(args.model, args.load_format, max_model_len, max(args.batch_sizes))
    engine = llm.engine
    runner = engine.core.executor
    hf_config = runner.hf_config
    lm_head_ms = hf_config.vocab_size * hf_config.hidden_size * 2 / (peaks["copy_tb_s"] * 1e12) * 1e3
    writer = harness.JsonlWriter(args.out, __file__, echo=None)
    for batch in tqdm(args.batch_sizes, desc="batch sizes"):
        setup.start_decode(engine, batch, args.input_len, num_decode + 16, num_warmup_steps=num_warmup)
        graph = setup.decode_graph(runner, batch)
        if graph is None:
            raise RuntimeError("no CUDA graph for this batch size (is the runner eager?)")
        context = args.input_len + num_warmup  # K/V tokens each row's attention reads now

        def replay(graph=graph) -> None:
            graph.replay()
            torch.cuda.synchronize()

        for name in args.passes:
            if name == "graph":  # replays do not advance the engine: the context stays
                summary = _profile(replay, args.steps, num_skip)
                unprofiled_ms = setup.graph_replay_ms(graph)
                pass_context = context
            else:
                pass_context = context + num_skip + args.steps / 2
                summary = _profile(engine.step, args.steps, num_skip)
                unprofiled_ms = step_device_ms(engine, args.steps)
                context += num_skip + 2 * args.steps
            floor_args = types.SimpleNamespace(dtype="bfloat16", input_len=pass_context, output_len=0,
                                               batch_sizes=[batch], prefill_len=0)
            floor_ms = offline.floors(hf_config, floor_args, peaks)["decode_step_ms"][str(batch)]
            if name == "graph":  # the captured forward stops before lm_head
                floor_ms -= lm_head_ms
            row = {"batch": batch, "pass": name, "context_len": pass_context,
                   "floor_ms": round(floor_ms, 4), "copy_tb_s": round(peaks["copy_tb_s"], 3),
                   "unprofiled_ms": round(unprofiled_ms, 4), **summary}
            print(format_summary(summary, f"batch {batch}, {name}", floor_ms, unprofiled_ms), flush=True)
            writer.write(row)
        setup.finish_requests(engine)


if __name__ == "__main__":
    main()

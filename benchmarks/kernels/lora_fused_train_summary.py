"""Summary table of `lora_fused_train.py`'s JSON lines: the three fused-kernel targets, per case.

For each (adapters, m, n = k) it prints the GPU time (sum of a step's kernels) of the base GEMM's
forward, each fused form's forward over it, the fused forward's two kernels apart (kernel 2 over
the base GEMM, with the form "auto" took; kernel 1's read of x in GB/s), and PEFT's (or the
unfused multi-adapter path's) forward + backward over the default fused path's; then the
averages the targets name: PEFT / fused (>= 1.27x on average, never below 1), the fused forward
over the base GEMM (<= 1.05x), and 4 adapters over the unfused path (>= 1.13x).

    python benchmarks/kernels/lora_fused_train_summary.py docs/results/lora-fused-train-h100-<date>.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsonl")
    args = p.parse_args()
    cases: dict[tuple[int, int, int], dict[str, dict]] = defaultdict(dict)
    for row in harness.read_jsonl(args.jsonl):
        cases[(row["num_adapters"], row["m"], row["n"])][row["path"]] = row
    forms = sorted({path.removeprefix("fused_") for rows in cases.values() for path in rows
                    if path.startswith("fused_") and not path.startswith("fused_multi")})
    print("| adapters | m | n = k | base fwd ms | fused fwd / base | " + " | ".join(f"{f} fwd / base" for f in forms)
          + " | kernel 2 / base (form) | kernel 1 ms (x read GB/s) | unfused / fused, fwd+bwd |")
    print("|" + "---:|" * (8 + len(forms)))
    kernel2_over_base: list[float] = []
    speedups: dict[int, list[float]] = defaultdict(list)
    fwd_over_base: list[float] = []
    for (adapters, m, n), rows in sorted(cases.items()):
        fused = "fused" if adapters == 1 else "fused_multi"
        unfused = "torch_lora" if adapters == 1 else "torch_multi"
        base = rows["base"]["gpu_fwd_ms"]
        speedup = rows[unfused]["gpu_fwd_bwd_ms"] / rows[fused]["gpu_fwd_bwd_ms"]
        speedups[adapters].append(speedup)
        ratio = rows[fused]["gpu_fwd_ms"] / base
        if adapters == 1:
            fwd_over_base.append(ratio)
        cells = [f"{rows[f'{fused}_{form}']['gpu_fwd_ms'] / base:.3f}" if f"{fused}_{form}" in rows else "-"
                 for form in forms]
        kernel1, kernel2 = rows.get("kernel1"), rows.get("kernel2")
        if kernel2:
            kernel2_over_base.append(kernel2["gpu_fwd_ms"] / base)
        split = (f"{kernel2['gpu_fwd_ms'] / base:.3f} ({kernel2['form']}) | "
                 f"{kernel1['gpu_fwd_ms']:.4f} ({kernel1['x_read_gbps']:.0f})" if kernel1 and kernel2 else "- | -")
        print(f"| {adapters} | {m} | {n} | {base:.4f} | {ratio:.3f} | " + " | ".join(cells)
              + f" | {split} | {speedup:.3f} |")
    for adapters, values in sorted(speedups.items()):
        print(f"{adapters} adapter(s): unfused / fused fwd+bwd mean {statistics.mean(values):.3f}x, "
              f"min {min(values):.3f}x, max {max(values):.3f}x")
    if fwd_over_base:
        print(f"1 adapter: fused fwd / base GEMM mean {statistics.mean(fwd_over_base):.3f}x, "
              f"min {min(fwd_over_base):.3f}x, max {max(fwd_over_base):.3f}x")
    if kernel2_over_base:
        print(f"all cases: kernel 2 alone / base GEMM mean {statistics.mean(kernel2_over_base):.3f}x, "
              f"min {min(kernel2_over_base):.3f}x, max {max(kernel2_over_base):.3f}x")


if __name__ == "__main__":
    main()

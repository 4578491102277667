"""Host <-> device copy bandwidth over pinned memory, alone and while a GEMM runs on the compute
stream (what `--finetune-activation-offload` relies on: its copies run on a side stream).

    python benchmarks/pcie_copy.py [--gib 1] [--out]

Prints one JSON line: the first cudaHostAlloc of a size (the caching host allocator's cost for a
new size), D2H and H2D GB/s alone, both again on a side stream under back-to-back bf16 GEMMs
([8192, 4096] x [4096, 14336]), and the GEMM's time alone and under each copy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes per copy [%(default)s GiB]")
    harness.add_out_argument(parser)
    args = parser.parse_args()
    n = int(args.gib * (1 << 30))
    t0 = time.perf_counter()
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    alloc_s = time.perf_counter() - t0
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    row = {"bytes": n, "pinned_alloc_s": round(alloc_s, 3)}
    # harness.mean_ms: back-to-back calls between two events, no synchronize after each call
    for name, fn in (("d2h", lambda: host.copy_(dev, non_blocking=True)),
                     ("h2d", lambda: dev.copy_(host, non_blocking=True))):
        row[f"{name}_gb_s"] = round(n / harness.mean_ms(fn, iters=5, warmup=2) / 1e6, 1)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
    gemm = lambda: x @ w.T  # noqa: E731
    row["gemm_ms"] = round(harness.mean_ms(gemm, iters=50, warmup=10), 3)
    side = torch.cuda.Stream()
    for name, fn in (("d2h", lambda: host.copy_(dev, non_blocking=True)),
                     ("h2d", lambda: dev.copy_(host, non_blocking=True))):
        torch.cuda.synchronize()
        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            c0.record(side)
            for _ in range(4):
                fn()
            c1.record(side)
        row[f"gemm_ms_under_{name}"] = round(harness.mean_ms(gemm, iters=50), 3)
        torch.cuda.synchronize()
        row[f"{name}_gb_s_under_gemm"] = round(4 * n / c0.elapsed_time(c1) / 1e6, 1)
    harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True)).write(row)


if __name__ == "__main__":
    main()

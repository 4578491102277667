"""Launch configurations of the fused LoRA training linear's own kernels, at LoRAFusion's shapes.

The blas form (`fused_lora_linear(..., base_gemm="blas")`) runs three LoRA kernels whose tiles,
warps, stages and grids are fixed in their launchers: kernel 1 (`lora_train_shrink_fwd`), kernel 3
(`lora_train_ds_db_bwd`) and the one pass of kernels 4's term and 5 (`lora_train_dx_term_da_bwd`).
For each m x n=k shape (one adapter over all tokens, rank 16, dropout 0.1, bf16) this times each
kernel at its launcher's default (the first row of each kind) and at the candidates below, each
passed as the launcher's keyword arguments. Times are GPU microseconds per call: the sum of the
call's CUDA kernels, its partial sums included (torch.profiler, --iters calls, L2 flushed before
each by a fill that is left out of the sum), which leaves out host launch time.

One JSON line per (shape, kernel, candidate) to --out; a summary per shape and kernel (default,
best, ratio) and a table of every candidate's time over the default's per shape to stdout.

    python benchmarks/kernels/lora_fused_train_tiles.py --out
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

SIZES = (4096, 5120, 8192)  # n = k
TOKENS = (2048, 4096, 8192)  # m
# None: the launcher's default. Otherwise the launcher's keyword arguments, in these orders:
# kernel 3: (block_m, block_n, num_warps, per_sm, num_stages)
DS_DB = (None, (128, 256, 8, 2, 3), (128, 256, 8, 1, 3), (64, 256, 8, 2, 3), (64, 256, 4, 2, 3), (32, 256, 4, 2, 3),
         (128, 128, 8, 2, 3), (64, 128, 4, 2, 3), (64, 128, 4, 4, 3), (128, 256, 8, 2, 2))
# the one pass: (block_m, block_k, num_warps, per_sm, max_chunks, num_stages)
TERM_DA = (None, (16, 128, 4, 4, 8, 3), (16, 128, 4, 4, 16, 3), (16, 128, 4, 4, 4, 3), (16, 128, 4, 8, 8, 3),
           (32, 128, 4, 4, 8, 3), (16, 256, 4, 4, 8, 3), (16, 64, 4, 4, 8, 3), (16, 128, 4, 4, 8, 4),
           (16, 128, 2, 4, 8, 3))
# kernel 1: (block_m, block_k, per_sm, num_stages, num_warps)
SHRINK = (None, (32, 128, 4, 3, 4), (32, 128, 6, 3, 4), (32, 128, 8, 3, 4), (32, 64, 4, 3, 4), (32, 256, 4, 3, 4),
          (16, 128, 4, 3, 4), (64, 128, 4, 3, 4), (32, 128, 4, 2, 4), (32, 128, 4, 4, 4))
KEYS = {"ds_db": ("block_m", "block_n", "num_warps", "per_sm", "num_stages"),
        "term_da": ("block_m", "block_k", "num_warps", "per_sm", "max_chunks", "num_stages"),
        "shrink": ("block_m", "block_k", "per_sm", "num_stages", "num_warps")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_out_argument(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.1)
    harness.add_timing_arguments(p, iters=15)
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="n = k values")
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="m values")
    args = p.parse_args()

    import torch
    from tqdm.auto import tqdm

    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
    from flexserve_kernels.lora.train.fused import LoRATrainSlots, lora_train_shrink_fwd
    from flexserve_kernels.lora.train.fused_bwd import (
        lora_train_ds_db_bwd,
        lora_train_dx_term_da_bwd,
    )

    device, dtype, rank = torch.device("cuda"), torch.bfloat16, args.rank
    flush = harness.l2_flush_buffer(device)

    def gpu_us(fn) -> float:
        """GPU microseconds per fn() (its kernels' sum), inf where the candidate fails to build."""
        try:
            kernels = harness.kernel_times(fn, iters=args.iters, warmup=3, flush_l2=flush)
        except Exception as exc:  # e.g. out of shared memory: the candidate is not launchable here
            tqdm.write(f"  failed: {type(exc).__name__}: {str(exc)[:160]}")
            return math.inf
        return sum(t.us for name, t in kernels.items() if "fill" not in name.lower() and "elementwise" not in name)

    writer = harness.JsonlWriter(args.out, __file__, echo=None)
    gpu = harness.gpu_name()
    table: dict[tuple, dict] = {}
    shapes = [(m, size) for size in args.sizes for m in args.tokens]
    for m, size in tqdm(shapes, desc="shapes"):
        g = torch.Generator().manual_seed(m + size)
        x = torch.randn(m, size, generator=g).to(device, dtype)
        dy = torch.randn(m, size, generator=g).to(device, dtype)
        lora_a = (torch.randn(1, rank, size, generator=g) / size**0.5).to(device, dtype)
        lora_b = (torch.randn(1, size, rank, generator=g) * 0.02).to(device, dtype)
        meta = LoRAKernelMeta.build([m], [0], device)
        slots = LoRATrainSlots.build([2.0], [args.dropout], device)
        s = lora_train_shrink_fwd(x, lora_a, meta, slots, 1234)
        ds, _ = lora_train_ds_db_bwd(dy, lora_b, s, meta, slots)
        calls = {
            "ds_db": functools.partial(lora_train_ds_db_bwd, dy, lora_b, s, meta, slots),
            "term_da": functools.partial(lora_train_dx_term_da_bwd, x, ds, lora_a, meta, slots, 1234),
            "shrink": functools.partial(lora_train_shrink_fwd, x, lora_a, meta, slots, 1234),
        }
        for kernel, candidates in (("ds_db", DS_DB), ("term_da", TERM_DA), ("shrink", SHRINK)):
            times = []
            for config in candidates:
                kwargs = dict(zip(KEYS[kernel], config)) if config else {}
                us = gpu_us(functools.partial(calls[kernel], **kwargs))
                times.append(us)
                table.setdefault((kernel, config), {})[(m, size)] = us
                writer.write(dict(m=m, n=size, k=size, rank=rank, dropout=args.dropout, kernel=kernel,
                                  config=kwargs or "default", gpu_us=round(us, 2), device=gpu))
            best = min(range(len(times)), key=times.__getitem__)
            tqdm.write(f"m={m} n=k={size} {kernel}: default {times[0]:.1f} us, best {candidates[best] or 'default'} "
                       f"{times[best]:.1f} us ({times[best] / times[0]:.3f}x)")
    print("candidate time / the launcher default's, per shape (" + ", ".join(f"{m}x{s}" for m, s in shapes) + ")")
    for (kernel, config), by_shape in table.items():
        if config is None:
            continue
        ratios = [by_shape[shape] / table[(kernel, None)][shape] for shape in shapes]
        print(f"{kernel:8s} {str(config):28s} " + " ".join(f"{r:6.3f}" for r in ratios)
              + f"   mean {sum(ratios) / len(ratios):.3f}")


if __name__ == "__main__":
    main()

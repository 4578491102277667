"""GPU sweep of kernel 1 of the fused LoRA training linear (the shrink, S = dropout(x) A^T).

For m in {2048, 4096, 8192} x in_size in {4096, 5120, 8192}, rank 16, bf16, one adapter slot over
all tokens, dropout 0.1 and 0.0, times `lora_train_shrink_fwd` in several configurations:
  old        the unsplit kernel: num_splits=1 (autotuned over SHRINK_CONFIG_SHAPES), column keys
             mixed in the kernel (key_table=False);
  default    the launcher's CUDA default (split-K by `shrink_split_plan`, SHRINK_* constants);
  others     split configurations around it (tiles, warps, programs per SM, the key table);
  read_floor not the shrink: torch's x.sum(dtype=float32), a reduction that reads x once, as the
             achievable read time of x at that size (launch and tail included).
Time per call = the sum of the CUDA kernels' self device time (torch.profiler) over --iters calls
after --warmup calls, divided by --iters: the Triton kernel plus anything else the call launches
(a zero fill of S when segments do not cover every token; none here). Calls rotate over enough
copies of x that they miss L2 (x is 16-128 MB, the H200's L2 50-60 MB), so GB/s
(m * in_size * 2 bytes / time) is against HBM. Every configuration's S is checked against
`lora_train_shrink_ref` (fp32 of the same bf16 inputs, |err| <= 3e-2 max|ref|) and against itself
on a second call (bitwise: split-K must stay deterministic).

One JSON line per (shape, dropout, config) to stdout and appended to --out.

    python benchmarks/kernels/lora_shrink_sweep.py --out
    python benchmarks/kernels/lora_shrink_sweep.py --dry-run      # parse arguments, list the configurations
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

# name -> lora_train_shrink_fwd keyword arguments
CONFIGS: dict[str, dict] = {
    "old": dict(num_splits=1, key_table=False),
    "default": dict(),
    "nokeys": dict(key_table=False),  # column keys mixed per tile, not loaded
    "ps2": dict(per_sm=2),
    "ps4": dict(per_sm=4),  # the default
    "ps6": dict(per_sm=6),
    "bm64": dict(block_m=64),
    "bm16": dict(block_m=16),
}
READ_FLOOR = "read_floor"
DEFAULT_CONFIGS = (READ_FLOOR, "old", "default", "nokeys", "ps2", "ps4", "ps6", "bm64", "bm16")


def parse_config(text: str) -> tuple[str, dict]:
    """'name' (from CONFIGS) or 'name:key=value,key=value' (integers; key_table=0/1)."""
    if ":" not in text:
        if text == READ_FLOOR:
            return text, {}
        if text not in CONFIGS:
            raise argparse.ArgumentTypeError(f"unknown config {text!r}; known: {', '.join(CONFIGS)}")
        return text, CONFIGS[text]
    name, _, body = text.partition(":")
    kwargs: dict = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        kwargs[key] = bool(int(value)) if key == "key_table" else int(value)
    return name, kwargs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192], help="m values")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 5120, 8192], help="in_size values")
    p.add_argument("--dropouts", type=float, nargs="+", default=[0.1, 0.0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--configs", type=parse_config, nargs="+", default=[parse_config(c) for c in DEFAULT_CONFIGS],
                   help="names from CONFIGS or name:key=value,... (keyword arguments of lora_train_shrink_fwd)")
    harness.add_timing_arguments(p, warmup=10, iters=50)
    p.add_argument("--rotate-mb", type=int, default=256, help="copies of x to rotate over, in MB (0: one x)")
    p.add_argument("--seed", type=int, default=1234)
    harness.add_out_argument(p)
    p.add_argument("--dry-run", action="store_true", help="parse arguments and print the plan; no GPU needed")
    return p.parse_args(argv)


def device_us(fn, iters: int, warmup: int) -> tuple[float, float]:
    """(all CUDA kernels, the Triton shrink kernel alone): self device microseconds per fn() call."""
    kernels = harness.kernel_times(fn, iters=iters, warmup=warmup)
    total = sum(t.us for t in kernels.values())
    shrink = sum(t.us for name, t in kernels.items() if "shrink" in name)
    return total, shrink


def main(argv=None) -> int:
    args = parse_args(argv)
    shapes = [(m, k) for m in args.tokens for k in args.sizes]
    total = len(shapes) * len(args.dropouts) * len(args.configs)
    print(f"{len(shapes)} shapes x {len(args.dropouts)} dropouts x {len(args.configs)} configs = {total} timings: "
          + ", ".join(f"{n}{kw or ''}" for n, kw in args.configs), file=sys.stderr, flush=True)
    if args.dry_run:
        return 0

    import torch

    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
    from flexserve_kernels.lora.train import fused
    from flexserve_kernels.lora.train.ref import lora_train_shrink_ref

    assert torch.cuda.is_available(), "needs CUDA (use --dry-run without)"
    device = torch.device("cuda")
    writer = harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True))
    start, done = time.perf_counter(), 0
    for m, in_size in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(m, in_size, generator=g, device=device, dtype=torch.bfloat16)
        copies = max(1, args.rotate_mb * 2**20 // x.nbytes) if args.rotate_mb else 1
        xs = [x] + [x.clone() for _ in range(copies - 1)]
        lora_a = (torch.randn(1, args.rank, in_size, generator=g, device=device) / in_size ** 0.5).to(torch.bfloat16)
        meta = LoRAKernelMeta.build([m], [0], device)
        for p in args.dropouts:
            slots = fused.LoRATrainSlots.build([2.0], [p], device)
            want = lora_train_shrink_ref(x, lora_a, meta.token_slots, [p], args.seed)
            scale = want.abs().max().item()
            for name, kwargs in args.configs:
                rotation = itertools.cycle(xs)
                floor = name == READ_FLOOR

                def call(kwargs=kwargs, slots=slots, floor=floor):
                    if floor:
                        return next(rotation).sum(dtype=torch.float32)
                    return fused.lora_train_shrink_fwd(next(rotation), lora_a, meta, slots, args.seed, **kwargs)

                if floor:
                    err, deterministic = 0.0, True
                else:
                    s = fused.lora_train_shrink_fwd(x, lora_a, meta, slots, args.seed, **kwargs)  # compiles, autotunes
                    again = fused.lora_train_shrink_fwd(x, lora_a, meta, slots, args.seed, **kwargs)
                    err = (s.float() - want).abs().max().item() / scale
                    deterministic = bool(torch.equal(s, again))
                us, shrink_us = device_us(call, args.iters, args.warmup)
                plan = None
                if kwargs.get("num_splits") != 1 and not floor:  # the launcher's plan, for the record
                    bm = kwargs.get("block_m", fused.SHRINK_BLOCK_M)
                    bk = kwargs.get("block_k", fused.SHRINK_BLOCK_K)
                    per_sm = kwargs.get("per_sm", fused.SHRINK_PER_SM)
                    plan = fused.shrink_split_plan(meta, in_size, args.rank, bm, bk, device, per_sm,
                                                   kwargs.get("num_splits"))
                row = dict(m=m, in_size=in_size, rank=args.rank, dropout=p, config=name, kwargs=kwargs,
                           k_per_split=plan and plan[0], num_splits=plan and plan[1], us=round(us, 3),
                           shrink_us=round(shrink_us, 3), gbps=round(m * in_size * 2 / us / 1e3, 1),
                           max_rel_err=err, ok=err <= 3e-2, deterministic=deterministic,
                           x_copies=len(xs), iters=args.iters)
                writer.write(row)
                done += 1
                print(f"[{done}/{total} {time.perf_counter() - start:.0f}s] {m}x{in_size} p={p} {name}: "
                      f"{us:.2f} us ({row['gbps']} GB/s) splits={row['num_splits']} err={err:.2g}",
                      file=sys.stderr, flush=True)
        del xs, x
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

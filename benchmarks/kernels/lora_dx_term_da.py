"""GPU benchmark of kernel 4's LoRA term: with kernel 5 in one pass (`lora_train_dx_term_da_bwd`), and alone.

The backward of an adapter's shrink needs dA = dS^T dropout(x) (kernel 5, `lora_train_da_bwd`) and
dX's LoRA term dropout'(dS A) (kernel 4's term, `lora_train_dx_term`). Each walks the [tokens, in]
tiles and hashes the same keep mask; the one pass reads x and writes the term once, with one mask.
For each tokens x in_size shape, one adapter over all tokens, rank 16, it times both ways in the
two forms that run: the fine-tuning engine's (fp32 term, dS as two bf16 halves) and the kernel
benchmark's blas form (bf16 term); next to the traffic floor (a copy of x into a tensor of the
term's size: x read once, the term written once). The one pass is also timed at a few tiles,
warps and programs per SM. Times are GPU microseconds per call: the sum of the call's CUDA
kernels (torch.profiler, 20 calls, L2 flushed before each), which leaves out host launch time (at
these sizes a Python launch of a Triton kernel can take longer than the kernel itself). The one
pass's term must equal the two kernels' bit for bit, and its dA (bf16, lora_a's dtype) must
match theirs to one bf16 step at max |dA| (2**-7 of it): the tiles change the order of the fp32
sums, and a sum near a rounding boundary of bf16 can land one step away.

--term-tiles adds the tile sweep of the term alone (`lora_train_dx_term`, what runs above
MAX_TERM_DA_RANK): every (BLOCK_M, BLOCK_N) x num_warps candidate in both forms, whose output
must equal the default's bit for bit (the tiles change no arithmetic). The term's default tiles
come from this sweep.

One JSON line per shape to stdout and appended to --out.

    python benchmarks/kernels/lora_dx_term_da.py [--term-tiles] --out
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

SHAPES = ((2048, 4096), (4096, 4096), (8192, 4096), (4096, 5120), (4096, 8192), (4096, 14336))
# (BLOCK_M, BLOCK_K, num_warps, programs per SM, most row chunks) tried besides the launcher's default
VARIANTS = ((32, 128, 4, 2, 8), (32, 128, 4, 8, 8), (32, 128, 4, 4, 16), (32, 128, 4, 8, 16), (32, 128, 4, 4, 32),
            (64, 128, 8, 4, 8), (32, 64, 4, 4, 8), (16, 128, 4, 4, 8), (16, 128, 4, 4, 16), (16, 128, 4, 8, 16))
# --term-tiles: the term alone at each (BLOCK_M, BLOCK_N) and warp count
TERM_TILES = ((16, 128), (16, 256), (32, 64), (32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 128))
TERM_WARPS = (2, 4, 8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_out_argument(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--term-tiles", action="store_true", help="also sweep the tiles of the term alone")
    args = p.parse_args()

    import torch
    from tqdm.auto import tqdm

    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
    from flexserve_kernels.lora.train.fused import LoRATrainSlots

    device = torch.device("cuda")
    flush = harness.l2_flush_buffer(device)
    writer = harness.JsonlWriter(args.out, __file__, echo=tqdm.write)

    def bench(fn, iters: int = 20) -> float:
        times = harness.kernel_times(fn, iters=iters, warmup=1, flush_l2=flush)
        # the flushes are fills; neither form launches one (every row has the adapter)
        return round(sum(t.us for name, t in times.items() if "Fill" not in name), 2)
    for m, k in tqdm(SHAPES, desc="dx term + dA"):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        ds = torch.randn(m, args.rank, device=device)
        lora_a = torch.randn(1, args.rank, k, device=device, dtype=torch.bfloat16) / k ** 0.5
        meta = LoRAKernelMeta.build([m], [0], device)
        slots = LoRATrainSlots.build([1.0], [args.dropout], device)
        row = dict(m=m, in_size=k, rank=args.rank, dropout=args.dropout)
        for dtype, name in ((torch.float32, "engine_fp32"), (torch.bfloat16, "blas_bf16")):
            row.update(bench_form(bench, name, dtype, x, ds, lora_a, meta, slots, args.term_tiles))
        writer.write(row)


def bench_form(bench, name, dtype, x, ds, lora_a, meta, slots, term_tiles: bool) -> dict:
    """Times of one output dtype's forms at one shape ({f"{name}_<form>_us": us}); checks every
    one-pass variant against the two kernels."""
    import torch

    from flexserve_kernels.lora.train.fused_bwd import (
        lora_train_da_bwd,
        lora_train_dx_term,
        lora_train_dx_term_da_bwd,
    )

    m, k = x.shape
    row = {}
    split = dtype == torch.float32  # the engine's form
    floor = torch.empty(m, k, device=x.device, dtype=dtype)
    row[f"{name}_floor_us"] = bench(functools.partial(floor.copy_, x))
    term = functools.partial(lora_train_dx_term, ds, lora_a, meta, slots, 5, out_dtype=dtype, split_ds=split)
    da_alone = functools.partial(lora_train_da_bwd, x, ds, lora_a, meta, slots, 5, split_ds=split)
    one_pass = functools.partial(lora_train_dx_term_da_bwd, x, ds, lora_a, meta, slots, 5, out_dtype=dtype,
                                 split_ds=split)

    def two_kernels():
        da = da_alone()
        return term(), da

    want_term, want_da = two_kernels()
    row[f"{name}_two_kernels_us"] = bench(two_kernels)
    row[f"{name}_dx_term_us"] = bench(term)
    row[f"{name}_da_us"] = bench(da_alone)
    for variant in ((None, None, None, None, 8),) + VARIANTS:
        bm, bk, warps, per_sm, chunks = variant
        tiles = dict(block_m=bm, block_k=bk, num_warps=warps, per_sm=per_sm, max_chunks=chunks)
        got_term, da = one_pass(**tiles)
        if not torch.equal(got_term, want_term):
            raise AssertionError(f"{name} {variant}: the term differs from kernel 4's")
        err = (da.float() - want_da.float()).abs().max().item()
        if err > 2 ** -7 * want_da.float().abs().max().item():
            raise AssertionError(f"{name} {variant}: dA differs from kernel 5's by {err:.3g}")
        label = "default" if bm is None else f"{bm}x{bk}_w{warps}_sm{per_sm}_c{chunks}"
        row[f"{name}_one_pass_{label}_us"] = bench(functools.partial(one_pass, **tiles))
    for (bm, bn), warps in itertools.product(TERM_TILES, TERM_WARPS) if term_tiles else ():
        run = functools.partial(term, blocks=(bm, bn), num_warps=warps)
        if not torch.equal(run(), want_term):
            raise AssertionError(f"{name}: the term at {bm} x {bn}, {warps} warps differs from the default")
        row[f"{name}_term_{bm}x{bn}_w{warps}_us"] = bench(run)
    return row


if __name__ == "__main__":
    main()

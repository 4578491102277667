"""GPU sweep of the tiles of kernel 4's LoRA term alone (`lora_train_dx_term`): dropout'(dS A).

The fine-tuning engine runs it in the backward of every adapter with dropout (fp32 output, dS as
two bf16 halves) and adds it in the frozen projection's dX GEMM; the kernel benchmark's blas form
writes it in bf16. For each tokens x in_size shape, rank 16, dropout 0.1, one adapter over all
tokens, times the kernel at every (BLOCK_M, BLOCK_N) x num_warps candidate, in both output
dtypes, next to a write floor (`zero_()` of a tensor of the output's size). Times are
`triton.testing.do_bench` medians (L2 flushed before each call). Every candidate's output must
equal the default's bit for bit (the tiles change no arithmetic).

One JSON line per shape to stdout and appended to --out.

    PYTHONPATH=... python benchmarks/kernels/lora_dx_term_sweep.py --out dx_term_sweep.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json

SHAPES = ((4096, 4096), (8192, 4096), (2048, 8192), (4096, 8192), (4096, 14336))
TILES = ((16, 128), (16, 256), (32, 64), (32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 128))
WARPS = (2, 4, 8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="append JSON lines here")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.1)
    args = p.parse_args()

    import torch
    import triton
    from tqdm.auto import tqdm

    from flexserve_kernels.lora_fused_train import LoRATrainSlots
    from flexserve_kernels.lora_fused_train_bwd import lora_train_dx_term
    from flexserve_kernels.lora_meta import LoRAKernelMeta

    device = torch.device("cuda")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")  # noqa: E731
    for m, k in tqdm(SHAPES, desc="dx term sweep"):
        ds = torch.randn(m, args.rank, device=device)
        lora_a = torch.randn(1, args.rank, k, device=device, dtype=torch.bfloat16)
        meta = LoRAKernelMeta.build([m], [0], device)
        slots = LoRATrainSlots.build([2.0], [args.dropout], device)
        row = dict(m=m, in_size=k, rank=args.rank, dropout=args.dropout, gpu=torch.cuda.get_device_name())
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            split = dtype == torch.float32  # the engine's form
            floor = torch.empty(m, k, device=device, dtype=dtype)
            row[f"write_floor_{name}_ms"] = bench(floor.zero_)
            default = lora_train_dx_term(ds, lora_a, meta, slots, 5, out_dtype=dtype, split_ds=split)
            row[f"default_{name}_ms"] = bench(lambda: lora_train_dx_term(ds, lora_a, meta, slots, 5, out_dtype=dtype,
                                                                         split_ds=split))
            for (bm, bn), warps in itertools.product(TILES, WARPS):
                run = lambda: lora_train_dx_term(ds, lora_a, meta, slots, 5, out_dtype=dtype,  # noqa: E731
                                                 split_ds=split, blocks=(bm, bn), num_warps=warps)
                if not torch.equal(run(), default):
                    raise AssertionError(f"{bm} x {bn} at {warps} warps differs from the default")
                row[f"{name}_{bm}x{bn}_w{warps}_ms"] = bench(run)
        line = json.dumps(row)
        tqdm.write(line)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()

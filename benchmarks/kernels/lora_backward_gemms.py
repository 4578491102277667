"""One layer's LoRA backward products on Llama-3.1-8B's down_proj (r=16, bf16): the 16-bit GEMMs
with fp32 outputs (`flexserve.worker.finetune.backward_ops`: dS split in two bf16 terms, dA, the bypass's
dX, and the frozen dX GEMM adding it in its epilogue) against widening the operands to fp32 and
rounding the frozen product before the sum, for windows of 16 to 4096 rows. The source of
`layer_backward.WIDE_LORA_GEMM_ROWS`.

    python benchmarks/kernels/lora_backward_gemms.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402
from flexserve.worker.finetune.backward_ops import addmm_fp32, mm_fp32, split_bf16

RANK, HIDDEN, INTER = 16, 4096, 14336


def mean_us(fn) -> float:
    return harness.wall_us(fn, iters=20, warmup=3).drained_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    args = parser.parse_args()
    bf16 = torch.bfloat16
    lora_a = torch.randn(RANK, INTER, device="cuda", dtype=bf16)
    weight = torch.randn(HIDDEN, INTER, device="cuda", dtype=bf16)  # down_proj: dX = dY W
    for n in tqdm(args.rows, desc="window rows"):
        act = torch.randn(n, INTER, device="cuda", dtype=bf16)  # m, the target's input
        d_s = torch.randn(n, RANK, device="cuda")  # dL/dS, fp32
        d_y = torch.randn(n, HIDDEN, device="cuda", dtype=bf16)

        def sixteen_bit(act=act, d_s=d_s, d_y=d_y):
            split = split_bf16(d_s)
            pair = mm_fp32(split.T, act)
            pair[:RANK] + pair[RANK:]  # dA
            return addmm_fp32(mm_fp32(split, torch.cat([lora_a, lora_a])), d_y, weight)

        def widened(act=act, d_s=d_s, d_y=d_y):
            d_s.T @ act.float()  # dA
            return (d_s @ lora_a.float()).add_(d_y @ weight)

        tqdm.write(f"{n} rows: 16-bit GEMMs {mean_us(sixteen_bit):.1f} us, widened {mean_us(widened):.1f} us")


if __name__ == "__main__":
    main()

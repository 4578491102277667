"""One-row projections and the greedy argmax: flexserve's Triton GEMV and argmax vs cuBLAS and
torch, on Llama-3.1-8B's decode shapes (bf16).

Each measurement is one CUDA graph of launches over distinct weights (32 per shape, 4 for the
1 GB lm_head, so nothing is served from the 50 MB L2), replayed 20 times and timed with CUDA
events; the median per launch in microseconds, and the bandwidth it implies. Part 1 sweeps the
GEMV's tile configs at one row on every shape (the source of `flexserve_kernels.gemv`'s config
table), then times the best dozen at 2 and 4
rows; part 2 times the lm_head with fp32 logits out and the argmax over 128,256 logits.

    python benchmarks/kernels/decode_gemv.py --out
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402
from flexserve_kernels.argmax import argmax
from flexserve_kernels.gemv import gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # (out_features, in_features)
# Tile configs: at least 8 elements per thread per step, at most 2048 x warps fp32 partial sums.
CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
           for bn, bk, w, s in itertools.product((2, 4, 8, 16, 32), (128, 256, 512, 1024, 2048), (2, 4, 8),
                                                 (1, 2, 3, 4))
           if 32 * w * 8 <= bn * bk <= 2048 * w]


def graph_us(fn, launches: int, reps: int = 20) -> float:
    """Median microseconds per launch of `fn` (which makes `launches` launches) replayed as a graph."""
    graph = harness.cuda_graph(fn, warmup=2)
    return harness.time_ms(graph.replay, iters=reps, warmup=1) * 1000 / launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_out_argument(parser)
    args = parser.parse_args()
    writer = harness.JsonlWriter(args.out, __file__, echo=tqdm.write)

    def emit(**record) -> None:
        writer.write(record)

    torch.manual_seed(0)
    best: dict[str, list] = {}
    for name, (n, k) in tqdm(SHAPES.items(), desc="shapes"):
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(4 if name == "lm_head" else 32)]
        nbytes = n * k * 2
        for rows in (1, 2, 4):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            us = graph_us(lambda x=x, weights=weights: [F.linear(x, w) for w in weights], len(weights))
            emit(shape=name, m=rows, impl="cublas", us=round(us, 2), tbps=round(nbytes / us / 1e6, 3))
            configs = CONFIGS if rows == 1 else [c for _, c in best[name][:12]]
            results = []
            for config in tqdm(configs, desc=f"{name} x {rows} rows", leave=False):
                us = graph_us(lambda x=x, weights=weights, config=config: [gemv(x, w, config=config) for w in weights],
                              len(weights))
                results.append((us, config))
            results.sort(key=lambda r: r[0])
            if rows == 1:
                best[name] = results
            for us, config in results[:15]:
                emit(shape=name, m=rows, impl="gemv", cfg=config, us=round(us, 2), tbps=round(nbytes / us / 1e6, 3))
        del weights
        torch.cuda.empty_cache()

    n, k = SHAPES["lm_head"]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]
    for rows in (1, 32):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        emit(shape="lm_head+float", m=rows, impl="cublas",
             us=round(graph_us(lambda x=x: [F.linear(x, w).float() for w in weights], 4), 2))
        if rows == 1:
            emit(shape="lm_head+float", m=rows, impl="gemv",
                 us=round(graph_us(lambda x=x: [gemv(x, w, out_dtype=torch.float32) for w in weights], 4), 2))
        logits = [torch.randn(rows, n, device="cuda") for _ in range(8)]
        torch_us = graph_us(lambda logits=logits: [t.argmax(-1) for t in logits], 8)
        triton_us = graph_us(lambda logits=logits: [argmax(t) for t in logits], 8)
        emit(shape="argmax", m=rows, impl="torch", us=round(torch_us, 2))
        emit(shape="argmax", m=rows, impl="triton", us=round(triton_us, 2))


if __name__ == "__main__":
    main()

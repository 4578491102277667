"""Decode LoRA per Llama-3.1-8B layer inside a CUDA graph: 14 BGMV launches vs the fused kernel's 4.

Per decoder layer a decode step with adapters runs, for each of the 7 LoRA'd projections, a BGMV
shrink and a BGMV expand (14 launches). The fused path runs lora_fused_bgmv once for q/k/v (3
projections on the normed hidden state), once for o, once for gate/up and once for down (4
launches); "fused_bgmv_down" keeps down on shrink + expand (5 launches), since down's A
(rank x 14336) is the one every fused program must stream whole. Each path is captured for 32
layers, each layer with its own weights (so they come from HBM, as in a real step), and replayed;
the JSON lines give microseconds per layer (replay time / layers).

    python benchmarks/lora_fused_kernel.py --out
    python benchmarks/lora_fused_kernel.py --smoke   # tiny shapes, CPU, Triton's interpreter, no timing
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

# (in, outs) of each fused launch of a Llama-3.1-8B layer: hidden 4096, q 4096, k/v 1024, MLP 14336.
LLAMA8B_LAUNCHES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
                    "down": (14336, (4096,))}
SMOKE_LAUNCHES = {"qkv": (64, (64, 16, 16)), "o": (64, (64,)), "gate_up": (64, (160, 160)), "down": (160, (64,))}
PATHS = {"bgmv": 14, "fused": 4, "fused_bgmv_down": 5}  # path -> launches per layer


def bench_layer_graph(
    batch: int, *, num_layers: int = 32, rank: int = 16, num_slots: int = 4, dtype: torch.dtype = torch.bfloat16,
    replays: int = 20, smoke: bool = False,
) -> dict:
    """Microseconds per layer of each path in PATHS, replayed from a CUDA graph of num_layers layers
    (smoke: run once on CPU, untimed). Decode rows use slots 0, 1, ..., num_slots - 1 in turn."""
    from flexserve_kernels.lora.serve.expand import lora_expand_bgmv
    from flexserve_kernels.lora.serve.fused import lora_fused_bgmv
    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
    from flexserve_kernels.lora.serve.shrink import lora_shrink_bgmv

    device = torch.device("cpu" if smoke else "cuda")
    launches = SMOKE_LAUNCHES if smoke else LLAMA8B_LAUNCHES
    g = torch.Generator().manual_seed(batch)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    token_slots = (torch.arange(batch, dtype=torch.int32) % num_slots).to(device)
    empty = token_slots[:0]
    # The decode-only metadata CUDAGraphRunner builds: BGMV reads token_slots only.
    meta = LoRAKernelMeta(token_slots=token_slots, seg_starts=empty, seg_lens=empty, seg_slots=empty,
                          num_tokens=batch, max_seg_len=1, decode_only=True)
    # Activations and outputs shared by the layers (one fused GEMM output per launch, sliced);
    # small deltas keep y finite over all replays.
    xs = {name: rand(batch, in_size) for name, (in_size, _) in launches.items()}
    wides = {name: rand(batch, sum(outs)) for name, (_, outs) in launches.items()}
    ys = {name: list(wides[name].split(list(launches[name][1]), dim=1)) for name in launches}
    layers = [
        {name: [(rand(num_slots, rank, in_size, scale=in_size**-0.5), rand(num_slots, n, rank, scale=1e-3),
                 torch.full((num_slots,), 2.0, device=device)) for n in outs]
         for name, (in_size, outs) in launches.items()}
        for _ in range(num_layers)
    ]

    def run(path: str) -> None:
        for layer in layers:
            for name, weights in layer.items():
                x = xs[name]
                if path == "bgmv" or (path == "fused_bgmv_down" and name == "down"):
                    for (a, b, scaling), y in zip(weights, ys[name]):
                        lora_expand_bgmv(lora_shrink_bgmv(x, a, meta), b, meta, y, scaling)
                else:
                    lora_fused_bgmv(x, [(a, b, s, y) for (a, b, s), y in zip(weights, ys[name])], token_slots)

    # Both paths from the same outputs must agree to about one rounding of y.
    start_values = {name: w.clone() for name, w in wides.items()}
    results = {}
    for path in ("bgmv", "fused"):
        run(path)
        results[path] = torch.cat([wides[name].float() for name in launches], dim=1)
        for name, w in wides.items():
            w.copy_(start_values[name])
    max_diff = (results["fused"] - results["bgmv"]).abs().max().item()

    row = dict(batch=batch, rank=rank, num_slots=num_slots, layers=num_layers, dtype=str(dtype).removeprefix("torch."),
               device="cpu-interpreter" if smoke else harness.gpu_name(),
               fused_vs_bgmv_max_abs_diff=max_diff)
    for path, num_launches in PATHS.items():
        if smoke:
            run(path)
            continue
        graph = harness.cuda_graph(functools.partial(run, path))  # the kernels compile outside the capture
        us_per_layer = harness.mean_ms(graph.replay, iters=replays, warmup=3) * 1e3 / num_layers
        row[f"{path}_us_per_layer"] = round(us_per_layer, 2)
        row[f"{path}_launches_per_layer"] = num_launches
        del graph
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--layers", type=int, default=32, help="layers captured in one graph (Llama-3.1-8B: 32)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=4)
    harness.add_out_argument(p)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1, untimed")
    args = p.parse_args()
    if args.smoke:
        # Before anything imports triton: the interpreter is chosen when functions are decorated.
        os.environ["TRITON_INTERPRET"] = "1"
    writer = harness.JsonlWriter(args.out, __file__, echo=lambda line: print(line, flush=True))
    for batch in args.batches:
        writer.write(bench_layer_graph(batch, num_layers=2 if args.smoke else args.layers, rank=args.rank,
                                       num_slots=args.slots, dtype=torch.float16 if args.smoke else torch.bfloat16,
                                       smoke=args.smoke))


if __name__ == "__main__":
    main()

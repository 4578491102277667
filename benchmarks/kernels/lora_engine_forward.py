"""The engine's LoRA forward of prefill-sized batches against LoRAFusion's fused kernels, per shape.

For each projection group of a Llama layer as the engine runs it (q/k/v merged, o, gate/up merged,
down; Llama-3.1-8B's sizes by default), rank 16, bf16, T tokens split over 1 or 4 adapters, times
the GPU work (the sum of the kernels' times, torch.profiler) of:
  engine      what the engine runs (`flexserve.layers.lora_linear.lora_group_forward` on the
              group's `LoRALinear`s): per projection kernel 1's shrink (no dropout) and kernel 2's
              term written into its column slice (fixed tiles, configs `lora_linear_term`), then
              one cuBLAS GEMM over the group's weight rows adding x W^T with the terms as C;
  sgmv        the SGMV path it replaces (and that smaller and decode batches keep): the frozen
              GEMM, then per projection the SGMV shrink and the in-place SGMV expand;
  kernel1     the SGMV path with kernel 1 as each shrink;
  fused_blas  kernel 1, then kernel 2 in its autotuned cuBLAS form (one projection per group: o,
              down);
  fused_tma   kernel 1, then kernel 2 in its TMA form (the LoRA term in the GEMM's accumulator);
  merged_blas / merged_tma (merged groups): one kernel 1 over the group's A side by side and one
              autotuned kernel 2 over the merged weight with the group's B block-diagonal (rank
              P x r; the TMA form only up to its widest rank);
  base        the frozen GEMM alone (the floor LoRA adds to).
With --term-tiles, also `engine_<block_m>x<block_n>w<warps>` for the term's candidate tiles.
Each case also records every path's max error against the SGMV path's output (relative to its
max |y|), so a wrong kernel shows in the JSON.

    python benchmarks/kernels/lora_engine_forward.py --out run.jsonl
    python benchmarks/kernels/lora_engine_forward.py --smoke   # tiny shapes, CPU, Triton's interpreter
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

# name: (in features, output sizes of the group's projections); Llama-3.1-8B.
GROUPS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
          "down": (14336, (4096,))}
SMOKE_GROUPS = {"qkv": (48, (32, 16, 16)), "o": (48, (48,)), "gate_up": (48, (64, 64)), "down": (64, (48,))}
TOKENS = (256, 512, 1024, 2048, 4096, 8192)
SMOKE_TOKENS = (256,)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--tokens", type=int, nargs="+", default=None, help=f"T values [{TOKENS}]")
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4], help="adapters splitting T [%(default)s]")
    p.add_argument("--groups", nargs="+", choices=tuple(GROUPS), default=list(GROUPS))
    harness.add_timing_arguments(p, warmup=5, iters=30)
    harness.add_out_argument(p)
    p.add_argument("--term-tiles", action="store_true", help="also time the term's candidate tiles")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    return p.parse_args()


# (block_m, block_n, num_warps) candidates of `lora_linear_term` (--term-tiles)
TERM_TILES = ((32, 128, 4), (64, 128, 4), (64, 128, 8), (64, 256, 8), (128, 128, 8), (128, 256, 8), (32, 64, 2))


def gpu_ms(fn, iters: int) -> float:
    """GPU milliseconds per fn() call: the sum of its kernels' times."""
    return sum(t.us for t in harness.kernel_times(fn, iters=iters).values()) / 1e3


def block_diagonal(lora_bs: list[torch.Tensor]) -> torch.Tensor:
    """[slots, sum(out), sum(r)]: each projection's B in its own rows and rank columns."""
    slots, rank = lora_bs[0].shape[0], lora_bs[0].shape[2]
    out = lora_bs[0].new_zeros(slots, sum(b.shape[1] for b in lora_bs), rank * len(lora_bs))
    row = 0
    for p, b in enumerate(lora_bs):
        out[:, row:row + b.shape[1], p * rank:(p + 1) * rank] = b
        row += b.shape[1]
    return out


def lora_linears(weight: torch.Tensor, sizes: tuple[int, ...], lora_as, lora_bs, scaling: float):
    """The group's projections as the engine holds them: `LoRALinear`s over views of the merged
    weight rows, each adapter in its own slot."""
    from torch import nn

    from flexserve.layers.lora_linear import LoRALinear

    modules, start = [], 0
    for size, a, b in zip(sizes, lora_as, lora_bs):
        base = nn.Linear(weight.shape[1], size, bias=False, device="meta")
        base.weight = nn.Parameter(weight[start:start + size], requires_grad=False)
        start += size
        module = LoRALinear(base, a.shape[0], a.shape[1])
        module.to(weight.device)
        for slot in range(a.shape[0]):
            module.set_slot(slot, a[slot], b[slot], scaling)
        modules.append(module)
    return tuple(modules)


def bench_case(group: str, in_size: int, sizes: tuple[int, ...], tokens: int, adapters: int, args, device,
               dtype) -> list[dict]:
    from flexserve.layers.lora_linear import lora_group_forward
    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
    from flexserve_kernels.lora.serve.ops import lora_expand, lora_shrink, lora_shrink_fused
    from flexserve_kernels.lora.train.fused import LoRATrainSlots, lora_linear_term, token_segments
    from flexserve_kernels.lora.train.fused_tma import MAX_TMA_RANK
    from flexserve_kernels.lora.train.linear import lora_train_linear_fwd

    g = torch.Generator().manual_seed(tokens + in_size + adapters)
    rank, scaling = args.rank, args.alpha / args.rank
    x = torch.randn(tokens, in_size, generator=g).to(device, dtype)
    weight = (torch.randn(sum(sizes), in_size, generator=g) / in_size**0.5).to(device, dtype)
    lora_as = [(torch.randn(adapters, rank, in_size, generator=g) / in_size**0.5).to(device, dtype) for _ in sizes]
    lora_bs = [(torch.randn(adapters, n, rank, generator=g) * 0.02).to(device, dtype) for n in sizes]
    seg = tokens // adapters
    meta = LoRAKernelMeta.build([seg] * (adapters - 1) + [tokens - seg * (adapters - 1)], list(range(adapters)),
                                device)
    token_segs = token_segments(meta)
    scalings = torch.full((adapters,), scaling, dtype=torch.float32, device=device)
    slots = LoRATrainSlots.build([scaling] * adapters, [0.0] * adapters, device)

    def sgmv_path(shrink):
        def run():
            y = F.linear(x, weight)
            for a, b, y_p in zip(lora_as, lora_bs, y.split(list(sizes), dim=-1)):
                lora_expand(shrink(a), b, meta, y_p, scalings)
            return y
        return run

    def kernel1(a):
        return lora_shrink_fused(x, a, meta)

    modules = lora_linears(weight, sizes, lora_as, lora_bs, scaling)

    def tiled(tile):
        def run():
            y = torch.empty(tokens, weight.shape[0], dtype=dtype, device=device)
            for m, y_p in zip(modules, y.split(list(sizes), dim=-1)):
                lora_linear_term(lora_shrink_fused(x, m.lora_a, meta), m.lora_b, meta, m.scaling, y_p,
                                 blocks=tile[:2], num_warps=tile[2])
            return y.addmm_(x, weight.t())
        return run

    paths = {"base": lambda: F.linear(x, weight), "sgmv": sgmv_path(lambda a: lora_shrink(x, a, meta)),
             "engine": lambda: lora_group_forward(modules, x, weight, meta), "kernel1": sgmv_path(kernel1)}
    if args.term_tiles and device.type == "cuda":
        paths.update({f"engine_{bm}x{bn}w{w}": tiled((bm, bn, w)) for bm, bn, w in TERM_TILES})
    forms = ("blas", "tma") if device.type == "cuda" else ("blas",)
    if len(sizes) == 1:
        for form in forms:
            paths[f"fused_{form}"] = (lambda f: lambda: lora_train_linear_fwd(
                x, weight, kernel1(lora_as[0]), lora_bs[0], meta, slots, token_segs, base_gemm=f))(form)
    else:
        a_cat = torch.cat(lora_as, dim=1).contiguous()
        b_diag = block_diagonal(lora_bs)
        for form in forms:
            if form == "tma" and b_diag.shape[2] > MAX_TMA_RANK:
                continue
            paths[f"merged_{form}"] = (lambda f: lambda: lora_train_linear_fwd(
                x, weight, kernel1(a_cat), b_diag, meta, slots, token_segs, base_gemm=f))(form)
    with torch.no_grad():
        want = paths["sgmv"]().float()
        errors = {name: ((fn().float() - want).abs().max() / want.abs().max()).item()
                  for name, fn in paths.items() if name != "base"}
    rows = []
    for name, fn in paths.items():
        with torch.no_grad():
            row = dict(path=name, fwd_ms=round(harness.time_ms(fn, iters=args.iters, warmup=args.warmup,
                                                               device=device), 4))
            if device.type == "cuda":
                row.update(gpu_ms=round(gpu_ms(fn, args.iters), 4))
        if name != "base":
            row.update(max_rel_err_vs_sgmv=float(f"{errors[name]:.3g}"))
        rows.append(row)
    key = "gpu_ms" if device.type == "cuda" else "fwd_ms"
    by_path = {r["path"]: r for r in rows}
    for r in rows:
        r.update(group=group, tokens=tokens, in_features=in_size, out_features=list(sizes), rank=rank,
                 num_adapters=adapters, dtype=str(dtype),
                 over_base=round(r[key] / by_path["base"][key], 4),
                 sgmv_over_path=round(by_path["sgmv"][key] / r[key], 4))
    return rows


def main() -> None:
    args = parse_args()
    device, dtype, device_name = harness.kernel_target(args.smoke)  # before triton is imported
    if args.smoke:
        args.warmup, args.iters = 0, 1
    groups = SMOKE_GROUPS if args.smoke else GROUPS
    tokens = SMOKE_TOKENS if args.smoke else (args.tokens or TOKENS)
    todo = [(grp, t, a) for grp in args.groups for a in args.adapters for t in tokens]
    writer = harness.JsonlWriter(args.out, __file__, echo=tqdm.write)
    for grp, t, a in tqdm(todo, desc="lora engine forward"):
        in_size, sizes = groups[grp]
        for row in bench_case(grp, in_size, sizes, t, a, args, device, dtype):
            writer.write(dict(row, device=device_name))
        if not args.smoke:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

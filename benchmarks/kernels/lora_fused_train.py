"""Fused LoRA training linear (LoRAFusion FusedLoRA / FusedMultiLoRA) vs PEFT's torch LoRA vs the base GEMM.

For n = k in {4096, 5120, 8192}, rank 16, m in {2048, 4096, 8192} tokens, bf16, times forward and
forward + backward (CUDA events, median of --iters after --warmup calls, which also run the
autotuner) of one LoRA linear:
  fused       flexserve_kernels.lora.train.fused.fused_lora_linear as it runs by default
              (base_gemm="auto": the forward's frozen GEMM in whichever of the blas and tma forms
              below timed faster at this shape, the backward's on cuBLAS);
  fused_blas  base_gemm="blas": Triton for the LoRA kernels, cuBLAS for the frozen GEMMs with the
              LoRA terms as their C operands;
  fused_tma   base_gemm="tma" (the frozen GEMMs in Triton over TMA, persistent, the LoRA products
              in their accumulators: no LoRA term through memory);
  torch_lora  PEFT's lora.Linear (base F.linear + dropout + lora_A + lora_B + scale + add, unfused);
  base        F.linear alone (forward, and backward to x only: W is frozen), the floor LoRA adds to;
  engine      forward only, no dropout: what the server's LoRALinear runs for prefill rows today
              (F.linear, then the SGMV shrink and the in-place SGMV expand of kernels/lora_ops.py);
              compare it with the fused forward at --dropout 0;
  kernel1     forward only: the fused path's kernel 1 alone, S = dropout(x) A^T (LoRAFusion's
              kernel 1, whose floor is one read of x: `x_read_gbps` is that read over its time);
  kernel2     forward only: the fused path's kernel 2 alone given S, y = x W^T + scaling * S B^T
              in the form "auto" picked at this shape (LoRAFusion's kernel 2, which the paper
              fuses "without affecting the base GEMM performance": compare it with base); on a
              Hopper GPU it also records the TMA form's autotuned tiles and tail split
              (`tma_tiles`, `tma_tail_tiles`, `tma_tail_split`: kernel 2's last round of tiles
              split over K where SMs would idle);
and a 4-adapter case (m / 4 tokens each, --multi-adapters): fused_multi (and fused_multi_<form> per
--forms) vs torch_multi (the unfused path per adapter: base F.linear once, each adapter's LoRA on its
rows, one add). Gradients are to x, A and B (W frozen) in every LoRA path. Each case also records
the fused path's max error vs torch at dropout 0 (relative to max |y|), so a broken kernel shows in
the JSON.

    python benchmarks/kernels/lora_fused_train.py --out
    python benchmarks/kernels/lora_fused_train.py --smoke   # tiny shapes, CPU, Triton's interpreter
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

SIZES = (4096, 5120, 8192)  # n = k
TOKENS = (2048, 4096, 8192)  # m
SMOKE_SIZES, SMOKE_TOKENS = (48,), (40,)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--dropout", type=float, default=0.1, help="LoRA dropout probability of every adapter")
    p.add_argument("--multi-adapters", type=int, default=4, help="adapters of the multi-adapter case (0: skip)")
    harness.add_timing_arguments(p, warmup=10, iters=30)
    harness.add_out_argument(p)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="n = k values (default: LoRAFusion's)")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="m values (default: LoRAFusion's)")
    p.add_argument("--forms", nargs="+", choices=("blas", "tma", "auto"), default=["blas", "tma"],
                   help="base_gemm forms timed besides the default (the fused path) [%(default)s]")
    p.add_argument("--kernel-table", action="store_true",
                   help="also print each path's CUDA kernels (torch.profiler, ms per step)")
    return p.parse_args()


def kernel_ms(fn, iters: int, table: str | None = None) -> float:
    """GPU milliseconds per fn() call: the sum of its CUDA kernels' times (torch.profiler), which
    leaves out host launch overhead and idle gaps. With `table`, prints the kernels under it."""
    kernels = harness.kernel_times(fn, iters=iters)
    if table:
        tqdm.write(f"-- {table}")
        for name, t in sorted(kernels.items(), key=lambda item: -item[1].us)[:12]:
            tqdm.write(f"  {t.us / 1e3:8.4f} ms  x{int(t.launches):<2d} {name[:110]}")
    return sum(t.us for t in kernels.values()) / 1e3


def peft_linear(weight: torch.Tensor, rank: int, alpha: float, dropout: float) -> torch.nn.Module:
    """PEFT's lora.Linear around a frozen bias-free nn.Linear holding weight."""
    from peft import LoraConfig
    from peft.tuners.lora import Linear as LoraLinear

    base = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    base.weight.data.copy_(weight)
    base.weight.requires_grad_(False)
    kwargs = dict(r=rank, lora_alpha=alpha, lora_dropout=dropout)
    if "config" in inspect.signature(LoraLinear.__init__).parameters:  # peft >= 0.18 takes the config too
        kwargs["config"] = LoraConfig(**kwargs)
    module = LoraLinear(base, "default", **kwargs).to(weight.device, weight.dtype)
    torch.nn.init.normal_(module.lora_B["default"].weight, std=0.02)  # PEFT starts B at zero
    return module


def step(forward, leaves: list[torch.Tensor], backward: bool):
    """One training step of a path: forward, then (if backward) dY = 1 backward, grads cleared first."""
    def run():
        for t in leaves:
            t.grad = None
        y = forward()
        if backward:
            y.backward(grad_out[0])
    grad_out: list[torch.Tensor] = []
    with torch.no_grad():
        grad_out.append(torch.ones_like(forward()))
    return run


FORWARD_ONLY = ("engine", "kernel1", "kernel2")


def fused_kernels(x, weight, lora_a, lora_b, meta, slots):
    """(kernel 1 alone, kernel 2 alone given its S, kernel 2's form, the TMA form's tiles and tail
    plan on a Hopper GPU, else {}): the two launches of the fused forward at seed 1234, kernel 2 in
    the form base_gemm="auto" runs here (timed once per shape)."""
    from flexserve_kernels.lora.train.fused import lora_train_shrink_fwd, token_segments
    from flexserve_kernels.lora.train.fused_tma import last_forward_plan, tma_forward_runs
    from flexserve_kernels.lora.train.linear import lora_train_linear_fwd, run_forms

    token_segs = token_segments(meta)
    s = lora_train_shrink_fwd(x, lora_a, meta, slots, 1234)
    form = run_forms("auto", x, weight, s, lora_b, meta, slots, token_segs)[0]
    plan = {}
    if x.is_cuda and tma_forward_runs(x, weight, lora_b.shape[2]):
        lora_train_linear_fwd(x, weight, s, lora_b, meta, slots, token_segs, base_gemm="tma")
        plan = last_forward_plan(x.shape[0], weight.shape[0], x.shape[1], x.device)
    return (lambda: lora_train_shrink_fwd(x, lora_a, meta, slots, 1234),
            lambda: lora_train_linear_fwd(x, weight, s, lora_b, meta, slots, token_segs, base_gemm=form), form, plan)


def bench_case(m: int, size: int, num_adapters: int, args, device, dtype) -> list[dict]:
    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
    from flexserve_kernels.lora.serve.ops import lora_expand, lora_shrink
    from flexserve_kernels.lora.train.fused import LoRATrainSlots
    from flexserve_kernels.lora.train.linear import fused_lora_linear

    g = torch.Generator().manual_seed(m + size + num_adapters)
    n = k = size
    rank, scaling = args.rank, args.alpha / args.rank
    x = (torch.randn(m, k, generator=g)).to(device, dtype).requires_grad_()
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    adapters = max(1, num_adapters)
    seg = m // adapters
    row_lens = [seg] * (adapters - 1) + [m - seg * (adapters - 1)]
    meta = LoRAKernelMeta.build(row_lens, list(range(adapters)), device)
    lora_a = (torch.randn(adapters, rank, k, generator=g) / k**0.5).to(device, dtype).requires_grad_()
    lora_b = (torch.randn(adapters, n, rank, generator=g) * 0.02).to(device, dtype).requires_grad_()
    leaves = [x, lora_a, lora_b]

    def fused(p: float, base_gemm: str = "auto"):
        slots = LoRATrainSlots.build([scaling] * adapters, [p] * adapters, device)
        return lambda: fused_lora_linear(x, weight, lora_a, lora_b, meta, slots, seed=1234, base_gemm=base_gemm)

    if num_adapters == 0:
        torch_module = peft_linear(weight, rank, args.alpha, args.dropout)
        torch_module.lora_A["default"].weight.data.copy_(lora_a[0].detach())
        torch_module.lora_B["default"].weight.data.copy_(lora_b[0].detach())
        torch_params = [x, torch_module.lora_A["default"].weight, torch_module.lora_B["default"].weight]
        torch_path, names = (lambda: torch_module(x)), ("fused", "torch_lora")
        torch_module.lora_dropout["default"].p = 0.0
        want = torch_module(x).detach()
        torch_module.lora_dropout["default"].p = args.dropout
    else:
        starts = [sum(row_lens[:i]) for i in range(adapters)]

        def torch_multi(p: float):
            base = F.linear(x, weight)
            deltas = [F.linear(F.linear(F.dropout(x[s:s + r], p), lora_a[i]), lora_b[i]) * scaling
                      for i, (s, r) in enumerate(zip(starts, row_lens))]
            return base + torch.cat(deltas)
        torch_params, torch_path, names = leaves, (lambda: torch_multi(args.dropout)), ("fused_multi", "torch_multi")
        with torch.no_grad():
            want = torch_multi(0.0)
    with torch.no_grad():
        errs = {gemm: ((fused(0.0, gemm)().float() - want.float()).abs().max() / want.float().abs().max()).item()
                for gemm in ("blas", "tma")}
    kernel1, kernel2, kernel2_form, tma_plan = fused_kernels(x.detach(), weight, lora_a.detach(), lora_b.detach(), meta,
                                                   LoRATrainSlots.build([scaling] * adapters, [args.dropout] * adapters,
                                                                        device))

    engine_scalings = torch.full((adapters,), scaling, dtype=torch.float32, device=device)

    def engine():
        with torch.no_grad():
            y = F.linear(x, weight)
            return lora_expand(lora_shrink(x, lora_a, meta), lora_b, meta, y, engine_scalings)

    paths = {names[0]: (fused(args.dropout), leaves),
             **{f"{names[0]}_{form}": (fused(args.dropout, form), leaves) for form in args.forms},
             names[1]: (torch_path, torch_params), "base": (lambda: F.linear(x, weight), [x]), "engine": (engine, []),
             "kernel1": (kernel1, []), "kernel2": (kernel2, [])}
    rows = []
    for path, (forward, params) in paths.items():
        backward = path not in FORWARD_ONLY
        row = dict(path=path, fwd_ms=round(harness.time_ms(step(forward, params, False), iters=args.iters,
                                                           warmup=args.warmup, device=device), 4))
        if backward:
            row.update(fwd_bwd_ms=round(harness.time_ms(step(forward, params, True), iters=args.iters,
                                                        warmup=args.warmup, device=device), 4))
        if not args.smoke:
            label = f"{path} m={m} n=k={size}" if args.kernel_table else None
            row.update(gpu_fwd_ms=round(kernel_ms(step(forward, params, False), args.iters, label), 4))
            if backward:
                row.update(gpu_fwd_bwd_ms=round(kernel_ms(step(forward, params, True), args.iters, label), 4))
        rows.append(row)
    by_path = {r["path"]: r for r in rows}
    torch_ms, base_ms = by_path[names[1]], by_path["base"]
    kernel1_ms = by_path["kernel1"].get("gpu_fwd_ms") or by_path["kernel1"]["fwd_ms"]
    by_path["kernel1"].update(x_read_gbps=float(f"{x.numel() * x.element_size() / kernel1_ms / 1e6:.4g}"))
    by_path["kernel2"].update(form=kernel2_form)
    by_path["kernel2"].update({f"tma_{key}": value for key, value in tma_plan.items()})
    for r in rows:
        r.update(m=m, n=n, k=k, rank=rank, num_adapters=adapters, dropout=args.dropout, dtype=str(dtype),
                 fused_max_rel_err=errs["blas"], fused_tma_max_rel_err=errs["tma"],
                 speedup_fwd_vs_torch=round(torch_ms["fwd_ms"] / r["fwd_ms"], 3),
                 fwd_over_base=round(r["fwd_ms"] / base_ms["fwd_ms"], 3))
        if "fwd_bwd_ms" in r:
            r.update(speedup_fwd_bwd_vs_torch=round(torch_ms["fwd_bwd_ms"] / r["fwd_bwd_ms"], 3))
        if "gpu_fwd_ms" in r:
            r.update(gpu_fwd_over_base=round(r["gpu_fwd_ms"] / base_ms["gpu_fwd_ms"], 3))
        if "gpu_fwd_bwd_ms" in r:
            r.update(gpu_speedup_fwd_bwd_vs_torch=round(torch_ms["gpu_fwd_bwd_ms"] / r["gpu_fwd_bwd_ms"], 3))
    return rows


def main() -> None:
    args = parse_args()
    device, dtype, device_name = harness.kernel_target(args.smoke)  # before triton is imported
    if args.smoke:
        args.warmup, args.iters = 0, 1
    sizes, tokens = (SMOKE_SIZES, SMOKE_TOKENS) if args.smoke else (args.sizes or SIZES, args.tokens or TOKENS)
    adapter_cases = [0, args.multi_adapters] if args.multi_adapters else [0]
    todo = [(m, s, a) for a in adapter_cases for s in sizes for m in tokens]
    writer = harness.JsonlWriter(args.out, __file__, echo=tqdm.write)
    for m, size, adapters in tqdm(todo, desc="lora fused train"):
        for row in bench_case(m, size, adapters, args, device, dtype):
            writer.write(dict(row, device=device_name))
        if not args.smoke:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

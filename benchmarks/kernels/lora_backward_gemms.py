"""The backward's LoRA ops of one window, per target shape and window size, in each way the engine
can run them (`flexserve.worker.finetune.layer_backward`), rank 16, bf16 model, fp32 gradients:

LoRA A's op (dA += dS^T x and dX's LoRA term dS A) with the frozen projection's dX GEMM:
  widened     the operands widened to fp32 (fp32 GEMMs), the frozen product rounded, then summed;
  gemm16      16-bit GEMMs with fp32 outputs (`mm_fp32`): dS as two bf16 terms (`split_bf16`), the
              frozen dX GEMM adding the term in its epilogue (`addmm_fp32`);
  kernels     fused LoRA kernels 4's term and 5 in one pass (`fused_lora_a_backward`, p = 0; dS as
              two bf16 halves), the frozen dX GEMM adding the term in its epilogue;
  frozen      the frozen dX GEMM alone (what LoRA adds to).
LoRA B's op (dB += scaling dY^T S and dS = scaling dY B) with dY in fp32:
  torch       fp32 GEMMs (the engine's path);
  kernel3     fused LoRA kernel 3 (`lora_train_ds_db_bwd`, fp32 operands: B widened first; dB summed
              in fp32).

Each path is captured in a CUDA graph, as the engine's backward windows run, and timed as the mean
of back-to-back replays between two events (the device's time with the gaps between kernels, no
host launch time). Every record also holds each path's max error against the fp64 result,
relative to the result's max |value|. The source of `layer_backward.WIDE_LORA_GEMM_ROWS` and of
the configs' `engine_lora_backward` (which path runs LoRA A's op at which window sizes).

    python benchmarks/kernels/lora_backward_gemms.py --out
    python benchmarks/kernels/lora_backward_gemms.py --smoke   # tiny shapes, CPU, Triton's interpreter
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402

# target: (in features, out features); Llama-3.1-8B.
TARGETS = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "o_proj": (4096, 4096),
           "gate_proj": (4096, 14336), "down_proj": (14336, 4096)}
SMOKE_TARGETS = {"q_proj": (48, 48), "down_proj": (64, 48)}
ROWS = (16, 64, 256, 1024, 2048, 4096)
SMOKE_ROWS = (16, 40)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rows", type=int, nargs="+", default=None, help=f"window rows [{ROWS}]")
    p.add_argument("--targets", nargs="+", choices=tuple(TARGETS), default=list(TARGETS))
    harness.add_timing_arguments(p, warmup=3, iters=50)
    harness.add_out_argument(p)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    return p.parse_args()


def rel_error(got, ref) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def timed_ms(fn, args) -> float | None:
    """Mean device ms of fn's graph replays (None on the CPU: the smoke run checks values only)."""
    if args.smoke:
        fn()
        return None
    graph = harness.cuda_graph(fn, warmup=args.warmup)
    return harness.mean_ms(graph.replay, iters=args.iters, warmup=2)


def lora_a_case(n: int, in_size: int, out_size: int, args, device, dtype) -> list[dict]:
    import torch

    from flexserve.worker.finetune.backward_ops import (
        addmm_fp32,
        fused_lora_a_backward,
        mm_fp32,
        split_bf16,
    )

    r = args.rank
    g = torch.Generator(device=device).manual_seed(n * 7 + in_size)
    act = torch.randn(n, in_size, device=device, dtype=dtype, generator=g)  # x, the target's input
    lora_a = (torch.randn(r, in_size, device=device, generator=g) / in_size ** 0.5).to(dtype)
    weight = (torch.randn(out_size, in_size, device=device, generator=g) / in_size ** 0.5).to(dtype)
    d_s = torch.randn(n, r, device=device, generator=g)  # dL/dS, fp32
    d_y = torch.randn(n, out_size, device=device, generator=g).to(dtype)
    grad_a = torch.zeros(r, in_size, device=device)
    ref_da = d_s.double().T @ act.double()
    ref_dx = d_s.double() @ lora_a.double() + d_y.double() @ weight.double()
    outs: dict[str, object] = {}

    def widened():
        grad_a.add_(d_s.T @ act.float())
        outs["dx"] = (d_s @ lora_a.float()).add_(d_y @ weight)

    def gemm16():
        split = split_bf16(d_s)
        pair = mm_fp32(split.T, act)
        grad_a.add_(pair[:r]).add_(pair[r:])
        outs["dx"] = addmm_fp32(mm_fp32(split, torch.cat([lora_a, lora_a])), d_y, weight)

    def kernels():
        term = fused_lora_a_backward(d_s, act, lora_a, 0.0, 0, grad_a, x_dropped=False, want_dx=True)
        outs["dx"] = addmm_fp32(term, d_y, weight)

    def frozen():
        outs["dx"] = d_y @ weight

    rows = []
    for name, fn in (("widened", widened), ("gemm16", gemm16), ("kernels", kernels), ("frozen", frozen)):
        grad_a.zero_()
        fn()
        errors = {}
        if name != "frozen":
            errors = dict(da_error=rel_error(grad_a, ref_da), dx_error=rel_error(outs["dx"], ref_dx))
        rows.append(dict(op="lora_a", path=name, ms=timed_ms(fn, args), **errors))
    return rows


def lora_b_case(n: int, out_size: int, args, device, dtype) -> list[dict]:
    import torch

    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
    from flexserve_kernels.lora.train.fused import LoRATrainSlots
    from flexserve_kernels.lora.train.fused_bwd import lora_train_ds_db_bwd

    r, scaling = args.rank, 2.0
    g = torch.Generator(device=device).manual_seed(n * 11 + out_size)
    d_y = torch.randn(n, out_size, device=device, generator=g)  # dL/dY, fp32
    s = torch.randn(n, r, device=device, generator=g)  # S = x A^T, fp32
    lora_b = (torch.randn(out_size, r, device=device, generator=g) / r).to(dtype)
    grad_b = torch.zeros(out_size, r, device=device)
    meta = LoRAKernelMeta.build([n], [0], device)
    slots = LoRATrainSlots.build([scaling], [0.0], device)
    ref_db = scaling * d_y.double().T @ s.double()
    ref_ds = scaling * d_y.double() @ lora_b.double()
    outs: dict[str, object] = {}

    def torch_path():
        grad_b.add_((d_y.T @ s) * scaling)
        outs["ds"] = (d_y @ lora_b.float()) * scaling

    def kernel3():
        outs["ds"], _ = lora_train_ds_db_bwd(d_y, lora_b.float()[None], s, meta, slots, db_out=grad_b[None])

    rows = []
    for name, fn in (("torch", torch_path), ("kernel3", kernel3)):
        grad_b.zero_()
        fn()
        errors = dict(db_error=rel_error(grad_b, ref_db), ds_error=rel_error(outs["ds"], ref_ds))
        rows.append(dict(op="lora_b", path=name, ms=timed_ms(fn, args), **errors))
    return rows


def main() -> None:
    args = parse_args()
    device, dtype, gpu = harness.kernel_target(args.smoke)  # before triton is imported
    targets = SMOKE_TARGETS if args.smoke else {t: TARGETS[t] for t in args.targets}
    rows = args.rows or (SMOKE_ROWS if args.smoke else ROWS)
    writer = harness.JsonlWriter(args.out, __file__, echo=tqdm.write)
    cases = [(t, n) for t in targets for n in rows]
    for target, n in tqdm(cases, desc="target x rows"):
        in_size, out_size = targets[target]
        rows_ab = lora_a_case(n, in_size, out_size, args, device, dtype) + lora_b_case(n, out_size, args, device, dtype)
        for row in rows_ab:
            writer.write(dict(target=target, rows=n, rank=args.rank, in_size=in_size, out_size=out_size,
                              gpu=gpu, **row))


if __name__ == "__main__":
    main()

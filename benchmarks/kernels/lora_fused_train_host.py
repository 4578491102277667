"""Host time of the fused LoRA training linear's launchers: what an eager training loop pays per call.

The kernel benchmark (lora_fused_train.py) reports GPU time, the sum of a step's kernels. An eager
loop also waits for the host to launch them: each Triton launch binds and specializes its
arguments in Python, and each launcher plans its grid and allocates its outputs first. For one
m x n=k shape (one adapter over all tokens, rank 16, dropout 0.1, bf16) this calls each piece 100
times back to back and reports host microseconds per call (time until the last call returns) and
the time until the GPU has drained them too; where the host time is the larger, the piece is
bound by the host. Pieces: triton.cdiv (a host-side helper), an empty Triton kernel with 16
arguments (the launch floor), torch.empty, an addmm, an autograd Function's forward+backward
that does nothing, each launcher of the blas form, the fused forward without grad, and a whole
fused step (forward + backward); PEFT's and the base linear's steps for comparison.

    python benchmarks/kernels/lora_fused_train_host.py [--tokens 2048 --size 4096] --out
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root (benchmarks/README.md)
from benchmarks import harness  # noqa: E402


@triton.jit
def _empty(p0, p1, p2, p3, p4, p5, n0, n1, n2, n3, n4, n5, n6, n7, A: tl.constexpr, B: tl.constexpr):
    pass  # the launch floor: a kernel with 16 arguments that does nothing


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="m")
    p.add_argument("--size", type=int, default=4096, help="n = k")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--calls", type=int, default=100)
    harness.add_out_argument(p)
    args = p.parse_args()

    import torch

    from benchmarks.kernels.lora_fused_train import peft_linear
    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
    from flexserve_kernels.lora.train.fused import (
        LoRATrainSlots,
        lora_train_shrink_fwd,
        token_segments,
    )
    from flexserve_kernels.lora.train.fused_bwd import (
        lora_train_ds_db_bwd,
        lora_train_dx_term_da_bwd,
    )
    from flexserve_kernels.lora.train.linear import fused_lora_linear, lora_train_linear_fwd

    device, dtype, m, size, rank = torch.device("cuda"), torch.bfloat16, args.tokens, args.size, args.rank
    x = torch.randn(m, size, device=device, dtype=dtype).requires_grad_()
    weight = torch.randn(size, size, device=device, dtype=dtype) / size**0.5
    lora_a = (torch.randn(1, rank, size, device=device, dtype=dtype) / size**0.5).requires_grad_()
    lora_b = (torch.randn(1, size, rank, device=device, dtype=dtype) * 0.02).requires_grad_()
    meta = LoRAKernelMeta.build([m], [0], device)
    slots = LoRATrainSlots.build([2.0], [0.1], device)
    dy = torch.ones(m, size, device=device, dtype=dtype)
    segs = token_segments(meta)
    with torch.no_grad():
        s = lora_train_shrink_fwd(x, lora_a, meta, slots, 1234)
        ds, _ = lora_train_ds_db_bwd(dy, lora_b, s, meta, slots)
    peft = peft_linear(weight, rank, 2.0 * rank, 0.1)
    peft_leaves = [x, peft.lora_A["default"].weight, peft.lora_B["default"].weight]

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return grad

    small = torch.randn(8, 8, device=device, requires_grad=True)
    small_grad = torch.ones(8, 8, device=device)

    def identity_step():
        small.grad = None
        Identity.apply(small).backward(small_grad)

    def fused_step():
        x.grad = lora_a.grad = lora_b.grad = None
        fused_lora_linear(x, weight, lora_a, lora_b, meta, slots, seed=1234).backward(dy)

    def peft_step():
        for t in peft_leaves:
            t.grad = None
        peft(x).backward(dy)

    def base_step():
        x.grad = None
        torch.nn.functional.linear(x, weight).backward(dy)

    xd, ad, bd = x.detach(), lora_a.detach(), lora_b.detach()
    pieces = {
        "triton.cdiv": lambda: triton.cdiv(size, 128),
        "empty_launch_16_args": lambda: _empty[(1,)](x, weight, lora_a, lora_b, dy, x, 1, 2, 3, 4, 5, 6, 7, 8,
                                                     A=True, B=16),
        "torch.empty": lambda: torch.empty(m, rank, device=device, dtype=dtype),
        "addmm": lambda: torch.addmm(dy, xd, weight.t()),
        "autograd_identity_fwd_bwd": identity_step,
        "shrink_fwd (kernel 1)": lambda: lora_train_shrink_fwd(xd, ad, meta, slots, 1234),
        "linear_fwd (kernel 2 + addmm)": lambda: lora_train_linear_fwd(xd, weight, s, bd, meta, slots, segs),
        "ds_db_bwd (kernel 3 + sums)": lambda: lora_train_ds_db_bwd(dy, bd, s, meta, slots),
        "dx_term_da_bwd (one pass + sum)": lambda: lora_train_dx_term_da_bwd(xd, ds, ad, meta, slots, 1234),
        "fused_fwd_no_grad": lambda: fused_lora_linear(xd, weight, ad, bd, meta, slots, seed=1234),
        "fused_step": fused_step,
        "peft_step": peft_step,
        "base_step": base_step,
    }
    writer = harness.JsonlWriter(args.out, __file__, echo=None)
    gpu = harness.gpu_name()
    for name, fn in pieces.items():
        t = harness.wall_us(fn, iters=args.calls, warmup=5)
        print(f"{name:34s} host {t.host_us:8.1f} us/call   drained {t.drained_us:8.1f} us/call", flush=True)
        writer.write(dict(piece=name, m=m, n=size, k=size, rank=rank, host_us=round(t.host_us, 1),
                          drained_us=round(t.drained_us, 1), device=gpu))


if __name__ == "__main__":
    main()

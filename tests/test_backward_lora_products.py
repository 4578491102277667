"""The layer-wise backward's LoRA product helpers (`backward_ops.mm_fp32`, `addmm_fp32`,
`split_bf16`): fp32 sums and outputs from 16-bit operands, against fp64 references.

On CPU the helpers widen their operands; on CUDA (the `gpu` tests) they are cuBLAS GEMMs with an
fp32 output (torch's out_dtype overloads). Either way a product of two 16-bit floats is exact in
fp32, so the results differ from fp64 only by fp32 summation: relative error <= 1e-5 of the sum
of |products|. `split_bf16` keeps 16 significant bits: |hi + lo - x| <= 2^-17 |x|.
"""

from __future__ import annotations

import pytest
import torch

from flexserve.worker.finetune.backward_ops import addmm_fp32, mm_fp32, split_bf16

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _skip_without(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _assert_fp32_sum(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c=None) -> None:
    a64, b64 = a.double().cpu(), b.double().cpu()
    expected = a64 @ b64 + (0 if c is None else c.double().cpu())
    scale = a64.abs() @ b64.abs() + (0 if c is None else c.double().abs().cpu())
    assert got.dtype == torch.float32
    assert bool(((got.double().cpu() - expected).abs() <= 1e-5 * scale + 1e-30).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mm_fp32_and_addmm_fp32_sum_in_fp32(device, dtype):
    _skip_without(device)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(37, 300, generator=g).to(device, dtype)
    b = torch.randn(300, 19, generator=g).to(device, dtype)
    c = torch.randn(37, 19, generator=g).to(device)
    _assert_fp32_sum(mm_fp32(a, b), a, b)
    _assert_fp32_sum(mm_fp32(b.T, a.T), b.T, a.T)  # transposed operands, as dA's GEMM reads
    before = c.clone()
    _assert_fp32_sum(addmm_fp32(c, a, b), a, b, c)
    assert torch.equal(c, before)  # c is read, never written


@pytest.mark.parametrize("device", DEVICES)
def test_split_bf16_keeps_sixteen_bits_and_joins_a_gemm(device):
    _skip_without(device)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 16, generator=g) * torch.logspace(-6, 3, 16)).to(device)
    split = split_bf16(x)
    assert split.dtype == torch.bfloat16 and split.shape == (64, 32)
    hi, lo = split.float().chunk(2, dim=1)
    assert bool(((hi + lo - x).abs() <= 2.0**-17 * x.abs()).all())
    # x @ w through the split: fp32 accuracy of the 16-bit w, not bf16's 2^-9 on x.
    w = torch.randn(16, 200, generator=g).to(device, torch.bfloat16)
    got = mm_fp32(split, torch.cat([w, w]))
    expected = x.double().cpu() @ w.double().cpu()
    scale = x.double().abs().cpu() @ w.double().abs().cpu()
    assert bool(((got.double().cpu() - expected).abs() <= 2e-5 * scale).all())
    only_hi = mm_fp32(split[:, :16], w)  # what dropping lo would give: visibly worse
    assert ((only_hi.double().cpu() - expected).abs() / scale).max() > 1e-4

"""The backward window's SDPA call (`backward_ops.window_attention`): K/V in their KV heads (GQA)
give the output and gradients of explicit attention over KV heads expanded to the query heads,
with dK, dV summed per KV head, for windows that end the sequence's prefix or cover it whole."""

from __future__ import annotations

import pytest
import torch

from flexserve.worker.finetune import backward_ops
from flexserve.worker.finetune.backward_ops import window_attention
from test_window_attention import autograd_nodes


def reference_attention(q, k, v, scale):
    """Explicit softmax attention: query i of the window (position end - n + i) sees keys
    0..end - n + i; query head h reads KV head h // (H / KV)."""
    n, end, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ kk.transpose(-1, -2)) * scale
    visible = torch.arange(end)[None, :] <= torch.arange(n)[:, None] + (end - n)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ vv


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-kv", "expanded-kv"])
@pytest.mark.parametrize("n, end", [(5, 9), (9, 9), (1, 7)])
def test_window_attention_equals_explicit_gqa(n, end, grouped, monkeypatch):
    # grouped: K/V go to SDPA as they are (what CUDA's flash path gets; here SDPA's math path);
    # expanded: the fallback where flash would not run, and the CPU's path.
    monkeypatch.setattr(backward_ops, "_grouped_kv_fused", lambda q, k, v: grouped)
    gen = torch.Generator().manual_seed(n * 100 + end)
    heads, kv_heads, dim, scale = 6, 2, 8, 0.3
    q, k, v = (torch.randn(1, h, rows, dim, generator=gen, dtype=torch.float64)
               for h, rows in ((heads, n), (kv_heads, end), (kv_heads, end)))
    grad = torch.randn(1, heads, n, dim, generator=gen, dtype=torch.float64)
    results = []
    for fn in (window_attention, reference_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, scale)
        out.backward(grad)
        results.append((out.detach(), *(t.grad for t in leaves)))
    assert results[0][2].shape == (1, kv_heads, end, dim)  # dK per KV head, summed in the group
    for ours, expected in zip(*results):
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    assert results[0][2][:, :, end - n:].abs().sum() > 0  # the window's own keys get gradient


def test_the_cpu_expands_kv_as_before():
    q, k = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 5, 8)
    assert not backward_ops._grouped_kv_fused(q, k, k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n, end", [(384, 384), (2039, 2039), (256, 1408)])
def test_cuda_window_attention_never_takes_cudnn(n, end):
    """cuDNN builds a plan per new shape (110-190 ms stalls on the H200): whole-prefix windows
    (is_causal) and offset windows alike run flash, and match the explicit reference in bf16."""
    gen = torch.Generator(device="cuda").manual_seed(n + end)
    heads, kv_heads, dim = 32, 8, 128
    q, k, v = (torch.randn(1, h, rows, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
               for h, rows in ((heads, n), (kv_heads, end), (kv_heads, end)))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = window_attention(*leaves, dim ** -0.5)
    nodes = autograd_nodes(out)
    assert not any("Cudnn" in name for name in nodes), nodes
    assert any("FlashAttention" in name for name in nodes), nodes
    expected = reference_attention(*(t.double().cpu() for t in (q, k, v)), dim ** -0.5)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=2e-2, atol=2e-2)

"""Whole-prefix backward windows on cuDNN, padded to bucket lengths (`backward_ops.prefix_bucket`,
`padded_prefix_attention`, `warm_prefix_attention`) and their start-up warm-up
(`finetune_warmup.warmup_window_attention`). The padding logic runs on the CPU through SDPA's math
backend; the cuDNN path itself needs CUDA (tests marked gpu)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend

from flexserve import envs
from flexserve.worker.finetune import backward_ops
from flexserve.worker.finetune import warmup as finetune_warmup
from flexserve.worker.finetune.backward_ops import (
    cudnn_prefix_buckets,
    padded_prefix_attention,
    prefix_bucket,
    prefix_buckets,
    warm_prefix_attention,
    window_attention,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def reference_attention(q, k, v, scale):
    """Explicit causal softmax attention over positions [0, end); query head h reads KV head
    h // (H / KV)."""
    end, group = q.shape[2], q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ kk.transpose(-1, -2)) * scale
    visible = torch.arange(end)[None, :] <= torch.arange(end)[:, None]
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ vv


def window_inputs(end, heads, kv_heads, dim, dtype, device="cpu", seed=0, layout="bshd"):
    """q [1, heads, end, dim], k, v [1, kv_heads, end, dim] and an output gradient. "bshd": views
    of [end, heads, dim] tensors, the layout `layer_backward` passes; "bhsd": contiguous."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def make(h):
        if layout == "bshd":
            t = torch.randn(end, h, dim, generator=gen, device=device, dtype=dtype)
            return t.transpose(0, 1).unsqueeze(0)
        return torch.randn(1, h, end, dim, generator=gen, device=device, dtype=dtype)

    return make(heads), make(kv_heads), make(kv_heads), make(heads)


def run(fn, q, k, v, grad, *args):
    """fn's output and (dq, dk, dv) of leaves made from q, k, v."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, *args)
    out.backward(grad)
    return (out.detach(), *(t.grad for t in leaves))


# ------------------------------------------------------------------------------------ buckets
@pytest.mark.parametrize("length, bucket", [
    (1, 128), (127, 128), (128, 128), (129, 256), (1000, 1024), (1024, 1024), (1025, 1152),
    (2048, 2048), (2049, 2304), (4000, 4096), (4096, 4096), (4097, 4608), (4112, 4608),
    (8192, 8192), (8193, 9216), (131072, 131072),
])
def test_prefix_bucket(length, bucket):
    assert prefix_bucket(length) == bucket


def test_prefix_bucket_pads_little_and_is_stable():
    previous = 0
    for length in range(1, 20000):
        bucket = prefix_bucket(length)
        assert bucket >= length and bucket % 128 == 0 and bucket >= previous
        assert prefix_bucket(bucket) == bucket  # a bucket length is its own bucket
        if length > 1024:
            assert (bucket - length) * 8 < length  # under 1/8 of the window
        else:
            assert bucket - length < 128
        previous = bucket
    with pytest.raises(ValueError):
        prefix_bucket(0)


def test_prefix_buckets_cover_every_length_once():
    buckets = prefix_buckets(4112)
    assert buckets == [128 * i for i in range(1, 17)] + [256 * i for i in range(9, 17)] + [4608]
    assert prefix_buckets(1) == [128] and prefix_buckets(1024)[-1] == 1024
    assert len(prefix_buckets(8192)) == 32 and len(prefix_buckets(131072)) == 64
    assert {prefix_bucket(n) for n in range(1, 4113)} == set(buckets)


def test_cudnn_buckets_start_where_cudnn_beats_flash():
    assert backward_ops.CUDNN_MIN_PREFIX_BUCKET == 3072
    assert cudnn_prefix_buckets(4112) == [3072, 3328, 3584, 3840, 4096, 4608]
    assert cudnn_prefix_buckets(2816) == [] and cudnn_prefix_buckets(2817) == [3072]
    assert cudnn_prefix_buckets(131072) == [b for b in prefix_buckets(131072) if b >= 3072]


def test_window_attention_mode(monkeypatch):
    monkeypatch.delenv("FLEXSERVE_WINDOW_ATTENTION", raising=False)
    assert envs.window_attention() == envs.DEFAULT_WINDOW_ATTENTION
    monkeypatch.setenv("FLEXSERVE_WINDOW_ATTENTION", "FLASH")
    assert envs.window_attention() == "flash"
    monkeypatch.setenv("FLEXSERVE_WINDOW_ATTENTION", "cudnn-buckets")
    assert envs.window_attention() == "cudnn-buckets"
    monkeypatch.setenv("FLEXSERVE_WINDOW_ATTENTION", "cudnn")
    with pytest.raises(ValueError, match="FLEXSERVE_WINDOW_ATTENTION"):
        envs.window_attention()


# ------------------------------------------------------------------------ padding, on the CPU
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("end, length", [
    (1, 128), (7, 128), (128, 128), (200, 256), (200, 237), (1025, 1152),
])
def test_padded_prefix_attention_equals_unpadded(end, length, heads, kv_heads, layout):
    """Outputs and dq, dk, dv of the padded call are those of the unpadded one (fp64, SDPA's
    math backend) and of explicit attention, for lengths that are and are not bucket lengths."""
    dim, scale = 8, 0.3
    q, k, v, grad = window_inputs(end, heads, kv_heads, dim, torch.float64, seed=end + length,
                                  layout=layout)
    padded = run(padded_prefix_attention, q, k, v, grad, scale, length, [SDPBackend.MATH])
    unpadded = run(padded_prefix_attention, q, k, v, grad, scale, end, [SDPBackend.MATH])
    explicit = run(reference_attention, q, k, v, grad, scale)
    assert [t.shape for t in padded] == [q.shape, q.shape, k.shape, v.shape]
    for ours, plain, expected in zip(padded, unpadded, explicit):
        torch.testing.assert_close(ours, plain, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)
    # The last real key gets dV (and, past one key, every key dK): padding took nothing away.
    assert padded[3][:, :, -1].abs().sum() > 0 and (end == 1 or padded[2].abs().sum() > 0)


def test_padded_prefix_attention_fp32():
    q, k, v, grad = window_inputs(300, 8, 2, 16, torch.float32, seed=3)
    padded = run(padded_prefix_attention, q, k, v, grad, 0.25, 384, [SDPBackend.MATH])
    explicit = run(reference_attention, *(t.double() for t in (q, k, v, grad)), 0.25)
    for ours, expected in zip(padded, explicit):
        torch.testing.assert_close(ours, expected.float(), rtol=1e-5, atol=1e-5)


def test_padding_layout_and_gradient_rows():
    """The padded copies and the output gradient handed to SDPA are [1, length, heads, D]
    storage whatever the inputs' layout (cuDNN's plan bakes those strides in), with zero rows
    past the window; the gradients of the window's rows are the first rows of the padded ones."""
    x = torch.randn(1, 3, 5, 4, requires_grad=True)  # contiguous [1, heads, rows, D]
    padded = backward_ops._PadRows.apply(x, 8)
    assert padded.shape == (1, 3, 8, 4) and padded.stride() == (8 * 3 * 4, 4, 3 * 4, 1)
    assert torch.equal(padded[:, :, :5], x) and not padded[:, :, 5:].any()
    taken = backward_ops._TakeRows.apply(padded, 5)
    grad = torch.randn(1, 3, 5, 4)
    (full,) = torch.autograd.grad(taken, padded, grad, retain_graph=True)
    assert full.stride() == (8 * 3 * 4, 4, 3 * 4, 1)
    assert torch.equal(full[:, :, :5], grad) and not full[:, :, 5:].any()
    (dx,) = torch.autograd.grad(taken, x, grad)
    assert torch.equal(dx, grad)


def test_cpu_windows_keep_their_path(monkeypatch):
    """The CPU never takes the cuDNN path (and builds no plan), whatever the mode."""
    monkeypatch.setenv("FLEXSERVE_WINDOW_ATTENTION", "cudnn-buckets")
    called = []
    monkeypatch.setattr(backward_ops, "padded_prefix_attention", lambda *a: called.append(a))
    q, k, v, grad = window_inputs(9, 6, 2, 8, torch.float64)
    assert warm_prefix_attention([128], 6, 2, 8, torch.float64, torch.device("cpu"), 0.3) == []
    ours = run(window_attention, q, k, v, grad, 0.3)
    expected = run(reference_attention, q, k, v, grad, 0.3)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert not called


# --------------------------------------------------------------------------------- the warm-up
def fake_executor(device="cuda"):
    attn = SimpleNamespace(num_heads=32, num_kv_heads=8, head_dim=128, scale=128 ** -0.5)
    layer = SimpleNamespace(self_attn=SimpleNamespace(attn=attn))
    return SimpleNamespace(device=torch.device(device), dtype=torch.bfloat16,
                           model=SimpleNamespace(model=SimpleNamespace(layers=[layer])))


def test_warmup_builds_every_bucket_up_to_the_longest_sequence(monkeypatch):
    calls = []

    def warm(lengths, *args):
        calls.append((lengths, args))
        return lengths[:-1]  # the largest did not fit

    monkeypatch.setattr(finetune_warmup, "warm_prefix_attention", warm)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setenv("FLEXSERVE_WINDOW_ATTENTION", "cudnn-buckets")
    built = finetune_warmup.warmup_window_attention(fake_executor(), 4112)
    (lengths, args), = calls
    assert lengths == cudnn_prefix_buckets(4112) and lengths[-1] == 4608
    assert args == (32, 8, 128, torch.bfloat16, torch.device("cuda"), 128 ** -0.5)
    assert built == lengths[:-1]
    assert finetune_warmup.warmup_window_attention(fake_executor(), 2048) == []  # all flash

    monkeypatch.setenv("FLEXSERVE_WINDOW_ATTENTION", "flash")
    assert finetune_warmup.warmup_window_attention(fake_executor(), 4112) is None
    monkeypatch.setenv("FLEXSERVE_WINDOW_ATTENTION", "cudnn-buckets")
    assert finetune_warmup.warmup_window_attention(fake_executor("cpu"), 4112) is None
    assert len(calls) == 1


def test_prepare_thread_rebuilds_the_plans_the_warm_up_built(monkeypatch):
    # The server's engine thread is not the loading thread, and cuDNN's plans are per thread:
    # the runner's prepare_thread builds them again there, for the length the warm-up used.
    from flexserve.worker.model_runner import ModelRunner

    calls = []
    monkeypatch.setattr(finetune_warmup, "warm_prefix_attention",
                        lambda lengths, *args: calls.append(lengths) or lengths)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setenv("FLEXSERVE_WINDOW_ATTENTION", "cudnn-buckets")
    executor = fake_executor()
    executor.warm_prefix_len = None
    ModelRunner.prepare_thread(executor)  # nothing warmed: nothing to rebuild
    assert calls == []
    finetune_warmup.warmup_window_attention(executor, 4112)
    assert executor.warm_prefix_len == 4112
    ModelRunner.prepare_thread(executor)
    assert calls == [cudnn_prefix_buckets(4112)] * 2


def test_warmup_finetune_warms_attention_up_to_max_finetune_len(monkeypatch):
    """Also when the engine's limits leave no room for the fine-tuning sequences."""
    seen = []
    monkeypatch.setattr(finetune_warmup, "warmup_window_attention",
                        lambda executor, max_len: seen.append(max_len))
    info = SimpleNamespace(max_model_len=1000, num_blocks=1, block_size=16)
    scheduler = SimpleNamespace(max_num_batched_tokens=8, max_num_seqs=4)
    for max_finetune_len, expected in ((None, 1000), (600, 600)):
        config = SimpleNamespace(finetune=SimpleNamespace(max_finetune_len=max_finetune_len),
                                 scheduler=scheduler)
        assert finetune_warmup.warmup_finetune(fake_executor(), info, config) is None
        assert seen[-1] == expected


# ------------------------------------------------------------------------------------ on CUDA
@pytest.fixture
def cold_plans():
    """This thread's warmed buckets, restored afterwards (other tests expect none)."""
    plans = backward_ops._warm_plans()
    saved = set(plans)
    plans.clear()
    yield plans
    plans.clear()
    plans.update(saved)


def autograd_nodes(out):
    nodes, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and type(node).__name__ not in nodes:
            nodes.add(type(node).__name__)
            todo.extend(next_fn for next_fn, _ in node.next_functions)
    return nodes


@pytest.mark.gpu
@cuda
def test_cuda_padded_cudnn_matches_flash(cold_plans, monkeypatch):
    """bf16, Llama-3.1-8B's heads: whole-prefix windows on cuDNN (padded, warmed) against the
    flash path and fp64; windows of one bucket with and without padding run one after the
    other (one plan, so its output gradient layout must be the same: `_TakeRows`)."""
    heads, kv_heads, dim = 32, 8, 128
    scale = dim ** -0.5
    ends = [4096, 4000, 2817, 3072, 5000]
    lengths = sorted({prefix_bucket(e) for e in ends})
    built = warm_prefix_attention(lengths, heads, kv_heads, dim, torch.bfloat16,
                                  torch.device("cuda"), scale)
    assert built == lengths
    for end in ends:
        q, k, v, grad = window_inputs(end, heads, kv_heads, dim, torch.bfloat16, "cuda", seed=end)
        monkeypatch.setenv("FLEXSERVE_WINDOW_ATTENTION", "flash")
        flash = run(window_attention, q, k, v, grad, scale)
        monkeypatch.setenv("FLEXSERVE_WINDOW_ATTENTION", "cudnn-buckets")
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = window_attention(*leaves, scale)
        nodes = autograd_nodes(out)
        assert any("Cudnn" in name for name in nodes), nodes
        assert not any("Flash" in name for name in nodes), nodes
        out.backward(grad)
        ours = (out.detach(), *(t.grad for t in leaves))
        expected = run(reference_attention, *(t.double().cpu() for t in (q, k, v, grad)), scale)
        for name, a, b, e in zip(("out", "dq", "dk", "dv"), ours, flash, expected):
            assert a.shape == b.shape, name
            scale_ = e.abs().max().item()
            # Both bf16 kernels sit about as far from fp64 as from each other.
            torch.testing.assert_close(a.double().cpu(), e, rtol=0, atol=2e-2 * scale_,
                                       msg=f"{name} at end {end}")
            torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=2e-2 * scale_,
                                       msg=f"{name} at end {end}")


@pytest.mark.gpu
@cuda
def test_cuda_unwarmed_buckets_and_other_threads_keep_flash(cold_plans, monkeypatch):
    """No plan is built mid-serving: a bucket this thread did not warm, a window with
    start > 0, and any window of another thread (torch keeps cuDNN plans per thread) run flash;
    so do windows under `CUDNN_MIN_PREFIX_BUCKET`, warmed or not."""
    monkeypatch.setenv("FLEXSERVE_WINDOW_ATTENTION", "cudnn-buckets")
    heads, kv_heads, dim = 32, 8, 128
    scale = dim ** -0.5
    assert warm_prefix_attention([512, 3584], heads, kv_heads, dim, torch.bfloat16,
                                 torch.device("cuda"), scale) == [512, 3584]

    def nodes_of(n, end):
        q, k, v, _ = window_inputs(end, heads, kv_heads, dim, torch.bfloat16, "cuda")
        q = q[:, :, end - n:]
        return autograd_nodes(window_attention(*(t.requires_grad_() for t in (q, k, v)), scale))

    assert any("Cudnn" in name for name in nodes_of(3500, 3500))
    # Under the minimum; bucket 4096 not warmed; start 300.
    for n, end in ((500, 500), (4000, 4000), (3200, 3500)):
        assert not any("Cudnn" in name for name in nodes_of(n, end)), (n, end)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(nodes_of(3500, 3500)))
    thread.start()
    thread.join()
    assert seen and not any("Cudnn" in name for name in seen[0]), seen

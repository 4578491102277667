"""The fine-tuning engine's fused LoRA A backward (`backward_ops.fused_lora_a_backward`: fused
LoRA kernels 5 and 4's term with the dropout mask regenerated from the window's seed, dS split into
two 16-bit halves, dA accumulated in place) and the dropout keep-mask kernel, against torch.

Without CUDA the kernels run under Triton's interpreter in fp32 (its bf16 tl.dot is wrong in
triton 3.9, see test_finetune_backward_kernels); with CUDA the same cases run compiled, plus bf16
and Llama-3.1-8B shapes. Tolerances: fp32 products in another summation order, 1e-5 relative to
the largest entry; the split dS (hi + lo within 2^-17 of it) against fp32 math: 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from _triton_interpret import import_kernels, interpreter_hooks, is_interpreted, library_is_compiled

(kf, kd, kb) = import_kernels(("flexserve_kernels.lora.train.fused", "flexserve_kernels.lora.train.dropout",
                               "flexserve_kernels.lora.train.fused_bwd"), interpret=not torch.cuda.is_available())

from flexserve.worker.finetune import backward_ops  # noqa: E402
from flexserve.worker.finetune.activation_store import dropout_keep_mask, dropout_window_seed  # noqa: E402
from flexserve_kernels.lora.train.ref import dropout_keep_ref, row_seed  # noqa: E402

INTERPRETED = is_interpreted(kd._dropout_keep_mask_kernel)
DEVICE = "cpu" if INTERPRETED else "cuda"
RUN_IN_CHILD = INTERPRETED and library_is_compiled()
DTYPES = [torch.float32] if INTERPRETED else [torch.float32, torch.bfloat16]

test_module_in_interpreter_child_process, _triton_interpret = interpreter_hooks(
    __file__, INTERPRETED, RUN_IN_CHILD)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(device=DEVICE, dtype=dtype)


def assert_close(got, expected, rel):
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= rel * expected.float().abs().max().item(), err


@pytest.mark.parametrize("seed", [0, 12345, 2**31 - 1, 2**31, 2**32 - 1])
def test_keep_mask_kernel_is_the_reference(seed):
    for p in (0.0, 0.1, 0.5):
        got = kd.dropout_keep_mask(seed, 37, 300, p, DEVICE)
        assert got.dtype == torch.bool and got.shape == (37, 300)
        assert torch.equal(got.cpu(), dropout_keep_ref(seed, 37, 300, p))


def test_row_seed_shifts_the_rows():
    full = dropout_keep_ref(77, 50, 64, 0.3)
    for start in (0, 1, 13, 49):
        assert torch.equal(dropout_keep_ref(row_seed(77, start), 50 - start, 64, 0.3), full[start:])
    # seeds near 2**32 wrap as the kernels' 32-bit sums do
    top = 2**32 - 5
    assert torch.equal(dropout_keep_ref(row_seed(top, 3), 10, 8, 0.5), dropout_keep_ref(top, 13, 8, 0.5)[3:])


def test_keep_mask_kernel_bad_input():
    with pytest.raises(ValueError, match="dropout probability"):
        kd.dropout_keep_mask(1, 4, 4, 1.0, DEVICE)
    with pytest.raises(ValueError, match="seed"):
        kd.dropout_keep_mask(2**32, 4, 4, 0.1, DEVICE)
    assert kd.dropout_keep_mask(1, 0, 8, 0.1, DEVICE).shape == (0, 8)


def test_engine_masks_are_split_invariant_on_this_path():
    whole = dropout_keep_mask(5, 3, "down_proj", 0, 40, 96, 0.25, DEVICE)
    parts = torch.cat([dropout_keep_mask(5, 3, "down_proj", a, b - a, 96, 0.25, DEVICE)
                       for a, b in ((0, 7), (7, 31), (31, 40))])
    assert torch.equal(whole, parts)
    assert torch.equal(whole.cpu(), dropout_keep_ref(dropout_window_seed(5, 3, "down_proj", 0), 40, 96, 0.25))
    rate = 1 - whole.float().mean().item()
    assert 0.15 < rate < 0.35
    assert not torch.equal(whole, dropout_keep_mask(5, 3, "up_proj", 0, 40, 96, 0.25, DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("n, width, rank", [(19, 24, 8), (1, 40, 1), (70, 130, 16)])
def test_lora_a_backward(dtype, p, n, width, rank):
    grad_s = randn(n, rank, seed=5, scale=1e-3)  # gradients are small: the split must keep them
    x, lora_a = randn(n, width, dtype=dtype, seed=6), randn(rank, width, dtype=dtype, seed=7)
    seed = row_seed(987654321, 11)
    keep = dropout_keep_ref(seed, n, width, p).to(DEVICE)
    scale = keep.float() / (1 - p)
    rel = 1e-5 if dtype == torch.float32 else 1e-4
    grad_a = randn(rank, width, seed=8)
    before = grad_a.clone()
    term = backward_ops.fused_lora_a_backward(grad_s, x, lora_a, p, seed, grad_a, x_dropped=False,
                                              want_dx=True)
    assert term.dtype == torch.float32 and term.shape == (n, width)
    assert_close(grad_a, before + grad_s.T @ (x.float() * scale), rel)
    assert_close(term, (grad_s @ lora_a.float()) * scale, rel)
    # x_dropped: the stored dropout output is read as it is; dX's term still gets the mask
    dropped = (x.float() * scale).to(dtype)
    grad_a.copy_(before)
    term2 = backward_ops.fused_lora_a_backward(grad_s, dropped, lora_a, p, seed, grad_a, x_dropped=True,
                                               want_dx=True)
    assert_close(grad_a, before + grad_s.T @ dropped.float(), rel)
    assert torch.equal(term2, term)
    assert backward_ops.fused_lora_a_backward(grad_s, x, lora_a, p, seed, grad_a, x_dropped=False,
                                              want_dx=False) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_engine_forward_shrink_is_the_masked_shrink(tiny_config, monkeypatch, dtype):
    # A fine-tuning step's LoRA shrink (`FinetuneCapture.lora_shrink`: one `lora_window_shrink`, fused
    # kernel 1 hashing every window's mask in registers where Triton runs) against dropout applied
    # as a tensor (`lora_input`: the masks the backward regenerates) before the plain shrink. Two
    # jobs with their own seeds and p, dropping out different targets; their windows at positions
    # past 0 and at flat offsets, with an inference adapter's rows and base rows around them.
    from types import SimpleNamespace

    from flexserve.peft.graph_pruning import plan_pruning
    from flexserve.peft.layer_graph import build_layer_graph
    from flexserve.worker.finetune.activation_store import ActivationStore, FinetuneCapture
    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
    from flexserve_kernels.lora.serve.ref import lora_shrink_ref

    if INTERPRETED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the capture's ops take Triton (interpreted)
    config = tiny_config("llama", num_hidden_layers=3)
    stores = []
    for targets, p, seed in ((("q_proj", "down_proj"), 0.3, 41), (("q_proj", "v_proj"), 0.1, 2**32 - 9)):
        graph = build_layer_graph(config, dict.fromkeys(targets, "lora"), rank=8, dropout=p)
        stores.append(ActivationStore(graph, plan_pruning(graph, 4), 3, 64, dtype, DEVICE, lora_dropout=p,
                                      dropout_seed=seed))
    for store, first in zip(stores, (9, 5)):
        store.begin_window(0, first)  # earlier windows: this step's start past 0
    capture = FinetuneCapture()
    capture.add_window(stores[0], 4, 9, 13, 1)  # flat rows 4-16, positions 9-21, slot 1
    capture.add_window(stores[1], 20, 5, 11, 2)  # flat rows 20-30, positions 5-15, slot 2
    meta = LoRAKernelMeta.build([4, 13, 3, 11, 2], [0, 1, -1, 2, 0], DEVICE)
    checked = 0
    for target, width in (("q_proj", config.hidden_size), ("v_proj", config.hidden_size),
                          ("down_proj", config.intermediate_size), ("o_proj", config.hidden_size)):
        x = randn(meta.num_tokens, width, dtype=dtype, seed=width)
        module = SimpleNamespace(target=target, layer_idx=2, max_rank=8,
                                 lora_a=randn(3, 8, width, dtype=dtype, seed=3, scale=width**-0.5))
        got = capture.lora_shrink(module, x, meta)
        want = lora_shrink_ref(capture.lora_input(module, x), module.lora_a, meta)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert_close(got, want, 1e-5 if dtype == torch.float32 else 1e-2)
        plain = lora_shrink_ref(x, module.lora_a, meta)
        dropped = target in ("q_proj", "down_proj"), target in ("q_proj", "v_proj")  # job 1's rows, job 2's
        for rows, drops in zip((slice(4, 17), slice(20, 31)), dropped):
            differs = (got[rows] - plain[rows]).abs().max() > 0.05 * plain[rows].abs().max()
            assert bool(differs) == drops, (target, rows)
        assert_close(got[:4], plain[:4], 1e-5 if dtype == torch.float32 else 1e-2)  # inference rows
        checked += 1
    assert checked == 4


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_rematerialized_dropout_shrink(dtype, p):
    # The backward's S of a dropout output it does not keep (`fused_lora_dropout_shrink`: kernel 1,
    # the mask hashed from the window's seed) against the torch path: dropout as a tensor, then A.
    n, width, rank = 37, 72, 8
    x, lora_a = randn(n, width, dtype=dtype, seed=9), randn(rank, width, dtype=dtype, seed=10, scale=0.2)
    seed = dropout_window_seed(17, 2, "up_proj", 300)
    keep = dropout_keep_mask(17, 2, "up_proj", 300, n, width, p, DEVICE)
    want = (x.float() * keep / (1 - p)) @ lora_a.float().T
    got = backward_ops.fused_lora_dropout_shrink(x, lora_a, p, seed)
    assert got.dtype == torch.float32 and got.shape == (n, rank)
    assert_close(got, want, 1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(backward_ops.fused_lora_dropout_shrink(x, lora_a, p, seed), got)


def test_reproducible():
    ds = randn(33, 4, seed=1)
    results = []
    for _ in range(2):
        grad_a = torch.zeros(4, 40, device=DEVICE)
        term = backward_ops.fused_lora_a_backward(ds, randn(33, 40, seed=4), randn(4, 40, seed=5), 0.2, 99,
                                                  grad_a, x_dropped=False, want_dx=True)
        results.append((grad_a, term))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_llama8b_down_proj_window_bf16():
    n, inter, rank, p = 1024, 14336, 16, 0.1
    ds, lora_a = randn(n, rank, seed=2, scale=1e-3), randn(rank, inter, dtype=torch.bfloat16, seed=4)
    x = randn(n, inter, dtype=torch.bfloat16, seed=5)
    grad_a = torch.zeros(rank, inter, device=DEVICE)
    seed = dropout_window_seed(3, 7, "down_proj", 2048)
    term = backward_ops.fused_lora_a_backward(ds, x, lora_a, p, seed, grad_a, x_dropped=False, want_dx=True)
    scale = dropout_keep_mask(3, 7, "down_proj", 2048, n, inter, p, DEVICE).float() / (1 - p)
    assert_close(grad_a, ds.T @ (x.float() * scale), 1e-4)
    assert_close(term, (ds @ lora_a.float()) * scale, 1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n, out, rank", [(19, 24, 8), (1, 40, 1), (70, 130, 16)])
def test_lora_b_backward(dtype, n, out, rank):
    # LoRA B's op as kernel 3 (`fused_lora_b_backward`): dB = scaling dY^T S added into the fp32
    # gradient, dS = scaling dY B, both in fp32 as the torch path's GEMMs.
    grad_y, s = randn(n, out, seed=11, scale=1e-3), randn(n, rank, seed=12)
    lora_b = randn(out, rank, dtype=dtype, seed=13)
    scaling = torch.tensor([2.5], device=DEVICE)
    grad_b = randn(out, rank, seed=14, scale=1e-3)
    before = grad_b.clone()
    ds = backward_ops.fused_lora_b_backward(grad_y, s, lora_b, scaling, grad_b)
    assert ds.dtype == torch.float32 and ds.shape == (n, rank)
    assert_close(grad_b, before + 2.5 * grad_y.T @ s, 1e-5)
    assert_close(ds, 2.5 * grad_y @ lora_b.float(), 1e-5)
    # S in the model's dtype is read as it is
    grad_b.copy_(before)
    backward_ops.fused_lora_b_backward(grad_y, s.to(dtype), lora_b, scaling, grad_b)
    assert_close(grad_b, before + 2.5 * grad_y.T @ s.to(dtype).float(), 1e-5)
    with pytest.raises(ValueError, match="db_out"):
        wide = torch.zeros(out, rank + 1, device=DEVICE)
        backward_ops.fused_lora_b_backward(grad_y, s, lora_b, scaling, wide[:, :rank])


def test_backward_benchmark_smoke_checks_every_path(tmp_path):
    # benchmarks/kernels/lora_backward_gemms.py --smoke (tiny shapes, interpreter, untimed): every
    # path of both LoRA ops writes a row, and each path's result matches fp64.
    from _benchmark_smoke import smoke_rows

    rows = smoke_rows("benchmarks/kernels/lora_backward_gemms.py", tmp_path / "bench.jsonl")
    paths = {(r["op"], r["path"]) for r in rows}
    assert paths == {("lora_a", p) for p in ("widened", "gemm16", "kernels", "frozen")} | {
        ("lora_b", p) for p in ("torch", "kernel3")}
    assert len(rows) == 6 * 2 * 2  # paths x targets x window sizes
    for r in rows:  # fp32 on the CPU; gemm16 splits dS in two bf16 terms (within 2^-17)
        for key in ("da_error", "dx_error", "db_error", "ds_error"):
            if key in r:
                assert r[key] < (1e-4 if r["path"] == "gemm16" else 1e-5), r

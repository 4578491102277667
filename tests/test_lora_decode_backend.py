"""Which kernels run a decode batch's LoRA bypass under FLEXSERVE_LORA_DECODE_BACKEND.

    auto (default)  fused (or folded) Triton groups for q/k/v, o, gate/up; down_proj's BGMV pair on
                    the CUDA extension for decode batches of at most CUDA_DECODE_MAX_ROWS (16)
                    tokens, Triton BGMV above; a folded down_proj group stays folded
    cuda            the CUDA pair for every projection and decode batch size
    triton          Triton only
    no extension    every backend runs what triton runs

On CPU the launchers are replaced by recorders (no Triton, no extension), the Triton path is
switched on and the extension's availability is set per test, so these check the routing alone,
for batches of 1, 16, 17 and 64 rows. On a GPU (marked gpu): with auto, down_proj's output at
Llama-3.1-8B shapes equals Triton's within bf16 rounding through the extension up to 16 rows and
is Triton's own above, eagerly and replayed from CUDA graphs captured per batch size; and the
engine loads the extension before it captures its graphs.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flexserve_kernels.lora.serve
from flexserve import envs
from flexserve.layers import lora_linear
from flexserve.layers.forward_context import set_forward_context
from flexserve.layers.lora_linear import LoRALinear, add_lora, folds_batch
from flexserve_kernels.lora.serve import cuda_ext
from flexserve_kernels.lora.serve import ops as lora_ops
from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
from flexserve_kernels.lora.serve.ref import lora_expand_ref, lora_shrink_ref

BACKENDS = ("auto", "cuda", "triton")
ROWS = (1, 16, 17, 64)
NUM_SLOTS, MAX_RANK = 8, 4
TRITON_PAIR = ["triton_bgmv_shrink", "triton_bgmv_expand"]
CUDA_PAIR = ["cuda_shrink", "cuda_expand"]


def decode_meta(num_rows: int, device="cpu") -> LoRAKernelMeta:
    """One token per row, neighbouring rows on different slots (so the batch is decode_only)."""
    meta = LoRAKernelMeta.build([1] * num_rows, [t % NUM_SLOTS for t in range(num_rows)], device)
    assert meta.decode_only and meta.num_tokens == num_rows
    return meta


def expected_down_pair(backend: str, num_rows: int, available: bool) -> list[str]:
    # 16: auto's cut-off (CUDA_DECODE_MAX_ROWS), written out so that changing it fails here
    if available and (backend == "cuda" or (backend == "auto" and num_rows <= 16)):
        return CUDA_PAIR
    return TRITON_PAIR


@pytest.fixture
def launches(monkeypatch):
    """The LoRA launchers replaced by recorders; returns (calls, set_available). The Triton path is
    on (as on CUDA) and the extension available until set_available(False)."""
    calls: list[str] = []

    def recorder(name, compute):
        def launch(*args, **kwargs):
            calls.append(name)
            return compute(*args)
        return launch

    def expand(s, b, meta, y, scaling):
        return lora_expand_ref(s, b, meta, y, scaling)

    fakes = {
        "shrink": dict(lora_shrink_bgmv=recorder("triton_bgmv_shrink", lora_shrink_ref),
                            lora_shrink_sgmv=recorder("triton_sgmv_shrink", lora_shrink_ref)),
        "expand": dict(lora_expand_bgmv=recorder("triton_bgmv_expand", expand),
                            lora_expand_sgmv=recorder("triton_sgmv_expand", expand)),
        "fused": dict(lora_fused_bgmv=recorder("fused", lambda x, groups, slots: None)),
        "expand_folded": dict(expand_bypass=recorder("folded_expand", lambda *a: None)),
    }
    for name, attrs in fakes.items():
        module = types.ModuleType(f"flexserve_kernels.lora.serve.{name}")
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, f"flexserve_kernels.lora.serve.{name}", module)
        monkeypatch.setattr(flexserve_kernels.lora.serve, name, module, raising=False)
    monkeypatch.setattr(cuda_ext, "lora_shrink_cuda", recorder(
        "cuda_shrink", lambda x, a, slots: torch.zeros(x.shape[0], a.shape[1])))
    monkeypatch.setattr(cuda_ext, "lora_expand_cuda", recorder("cuda_expand", lambda s, b, slots, y, sc: y))
    monkeypatch.setattr(lora_ops, "use_triton", lambda device: True)
    monkeypatch.setattr(lora_linear, "use_triton", lambda device: True)
    available = {"value": True}
    monkeypatch.setattr(cuda_ext, "cuda_bgmv_loaded", lambda device: available["value"])
    return calls, lambda value: available.update(value=value)


def _lora_linear(target: str, in_size: int = 24, out_size: int = 16, seed: int = 0) -> LoRALinear:
    g = torch.Generator().manual_seed(seed)
    module = LoRALinear(nn.Linear(in_size, out_size, bias=False), NUM_SLOTS, MAX_RANK, 0, target)
    for slot in range(NUM_SLOTS):
        module.set_slot(slot, torch.randn(MAX_RANK, in_size, generator=g),
                        torch.randn(out_size, MAX_RANK, generator=g), 0.5)
    return module


def _run_add_lora(module: LoRALinear, meta: LoRAKernelMeta) -> None:
    x = torch.randn(meta.num_tokens, module.in_features)
    add_lora((module,), x, (F.linear(x, module.weight),), meta)


# ------------------------------------------------------------------------------------ decisions
def test_default_backend_is_auto_and_bad_values_raise(monkeypatch):
    monkeypatch.delenv("FLEXSERVE_LORA_DECODE_BACKEND", raising=False)
    assert envs.lora_decode_backend() == "auto"
    assert cuda_ext.CUDA_DECODE_MAX_ROWS == 16
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", "cublas")
    with pytest.raises(ValueError, match="FLEXSERVE_LORA_DECODE_BACKEND must be one of"):
        envs.lora_decode_backend()
    with pytest.raises(ValueError, match="FLEXSERVE_LORA_DECODE_BACKEND must be one of"):
        cuda_ext.cuda_decode_wanted("cuda", decode_meta(4))
    with pytest.raises(ValueError, match="FLEXSERVE_LORA_DECODE_BACKEND must be one of"):
        cuda_ext.load_for_decode("cuda")


@pytest.mark.parametrize("available", [True, False], ids=["ext", "no-ext"])
@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decisions_per_backend_and_batch_size(backend, num_rows, available, launches, monkeypatch):
    _, set_available = launches
    set_available(available)
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", backend)
    meta = decode_meta(num_rows)
    wanted = expected_down_pair(backend, num_rows, available) == CUDA_PAIR
    assert cuda_ext.cuda_decode_wanted("cuda", meta) is wanted
    assert cuda_ext.cuda_decode_replaces_fused("cuda", meta) is (backend == "cuda" and available)
    # The fused / folded Triton groups keep decode batches except under cuda with the extension.
    assert folds_batch(torch.empty(num_rows, 8), meta) is not (backend == "cuda" and available)
    # The same answer every time for a batch size (a CUDA graph per size replays its capture).
    assert all(cuda_ext.cuda_decode_wanted("cuda", decode_meta(num_rows)) is wanted for _ in range(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_batches_with_prefill_rows_never_take_the_extension(backend, launches, monkeypatch):
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", backend)
    for row_lens, row_slots in (([3, 1], [0, 1]), ([1, 1], [2, 2]), ([40, 1, 1], [0, 1, -1])):
        meta = LoRAKernelMeta.build(row_lens, row_slots, "cpu")
        assert not meta.decode_only and not cuda_ext.cuda_decode_wanted("cuda", meta)


def test_cpu_device_never_takes_the_extension(monkeypatch):
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", "cuda")
    assert not cuda_ext.cuda_bgmv_available("cpu")
    assert not cuda_ext.cuda_decode_wanted("cpu", decode_meta(4))


# ------------------------------------------------------------------------------------- launches
@pytest.mark.parametrize("available", [True, False], ids=["ext", "no-ext"])
@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_launches_per_backend_and_batch_size(backend, num_rows, available, launches, monkeypatch):
    calls, set_available = launches
    set_available(available)
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", backend)
    meta = decode_meta(num_rows)
    _run_add_lora(_lora_linear("down_proj"), meta)
    assert calls == expected_down_pair(backend, num_rows, available)
    calls.clear()
    _run_add_lora(_lora_linear("q_proj"), meta)  # a fused target
    assert calls == (CUDA_PAIR if backend == "cuda" and available else ["fused"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_sized_batches_keep_triton(backend, launches, monkeypatch):
    calls, _ = launches
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", backend)
    _run_add_lora(_lora_linear("down_proj"), LoRAKernelMeta.build([5, 1], [0, 1], "cpu"))
    assert calls == TRITON_PAIR  # 6 tokens: BGMV, but not a decode-only batch
    calls.clear()
    _run_add_lora(_lora_linear("down_proj"), LoRAKernelMeta.build([70, 1], [0, 1], "cpu"))
    assert calls == ["triton_sgmv_shrink", "triton_sgmv_expand"]


def test_explicit_variant_runs_triton_even_where_auto_takes_the_extension(launches, monkeypatch):
    calls, _ = launches
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", "auto")
    meta = decode_meta(16)
    x, a = torch.randn(16, 24), torch.randn(NUM_SLOTS, MAX_RANK, 24)
    b, y, scaling = torch.randn(NUM_SLOTS, 16, MAX_RANK), torch.randn(16, 16), torch.ones(NUM_SLOTS)
    lora_ops.lora_expand(lora_ops.lora_shrink(x, a, meta, variant="bgmv"), b, meta, y, scaling, variant="bgmv")
    assert calls == TRITON_PAIR
    calls.clear()
    lora_ops.lora_expand(lora_ops.lora_shrink(x, a, meta), b, meta, y, scaling)
    assert calls == CUDA_PAIR


@pytest.mark.parametrize("num_rows", [1, 16, 64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_folded_down_group_stays_folded_except_under_cuda(backend, num_rows, launches, monkeypatch):
    # down_proj's A rows folded into its GEMM (the engine's default on CUDA while they fit):
    # auto keeps the folded GEMM and one expand, as triton does; cuda unfolds to the CUDA pair.
    from flexserve.model.llama import MergedProjection

    calls, _ = launches
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", backend)
    down = _lora_linear("down_proj", in_size=24, out_size=40)
    group = MergedProjection()
    assert group.fold_lora((down,), max_fraction=10.0)
    meta = decode_meta(num_rows)
    with set_forward_context(None, meta):
        group(torch.randn(num_rows, 24), (down,))
    assert calls == (CUDA_PAIR if backend == "cuda" else ["folded_expand"])


# --------------------------------------------------------------------------- start-up and logs
@pytest.mark.parametrize("backend,device,pairs,loads", [
    ("auto", "cuda", True, True), ("cuda", "cuda", True, True), ("triton", "cuda", True, False),
    ("auto", "cpu", True, False),
    # every down_proj folded: auto never runs a BGMV pair, cuda still sends every projection there
    ("auto", "cuda", False, False), ("cuda", "cuda", False, True),
])
def test_load_for_decode_builds_only_when_decode_may_use_it(backend, device, pairs, loads, monkeypatch, caplog):
    attempts = []
    monkeypatch.setattr(cuda_ext, "load_lora_bgmv", lambda: attempts.append(1) or "ops")
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", backend)
    with caplog.at_level(logging.INFO, logger="flexserve_kernels.lora.serve.cuda_ext"):
        result = cuda_ext.load_for_decode(device, bgmv_pairs=pairs)
    assert (result == "ops") is loads and len(attempts) == int(loads)
    ready = [r.getMessage() for r in caplog.records if "ready for LoRA decode in" in r.getMessage()]
    assert len(ready) == int(loads) and all(f"BACKEND={backend}" in m for m in ready)


@pytest.mark.parametrize("backend,level", [("auto", logging.INFO), ("cuda", logging.WARNING)])
def test_unavailable_extension_logs_one_line_saying_why(backend, level, fresh_loader, monkeypatch, caplog):
    # Falling back is expected under the default (auto), a problem when cuda was asked for.
    monkeypatch.setenv("FLEXSERVE_CUDA_EXT", "0")
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", backend)
    with caplog.at_level(logging.INFO, logger="flexserve_kernels.lora.serve.cuda_ext"):
        assert cuda_ext.load_for_decode("cuda") is None
        assert not cuda_ext.cuda_decode_wanted("cuda", decode_meta(4))
        assert not cuda_ext.cuda_decode_wanted("cuda", decode_meta(16))
    lines = [r for r in caplog.records if "CUDA BGMV extension unavailable" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == level
    assert "FLEXSERVE_CUDA_EXT=0" in lines[0].getMessage()


# ------------------------------------------------------------------------------------------- GPU
DOWN_IN, DOWN_OUT, RANK = 14336, 4096, 16  # Llama-3.1-8B's down_proj, rank 16, 8 adapters
BF16_TOL = dict(atol=1e-2, rtol=1.6e-2)  # one bf16 ulp of y for a final rounding that flips


@pytest.fixture(scope="module")
def llama_down():
    g = torch.Generator().manual_seed(0)
    base = nn.Linear(DOWN_IN, DOWN_OUT, bias=False, device="cuda", dtype=torch.bfloat16)
    module = LoRALinear(base, NUM_SLOTS, RANK, 0, "down_proj")
    for slot in range(NUM_SLOTS):
        module.set_slot(slot, (torch.randn(RANK, DOWN_IN, generator=g) / DOWN_IN**0.5).to("cuda", torch.bfloat16),
                        (torch.randn(DOWN_OUT, RANK, generator=g) * 0.02).to("cuda", torch.bfloat16), 2.0)
    return module


def _spy_cuda(monkeypatch) -> list[str]:
    calls = []
    for name in ("lora_shrink_cuda", "lora_expand_cuda"):
        real = getattr(cuda_ext, name)
        monkeypatch.setattr(cuda_ext, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    return calls


def _bypass(module: LoRALinear, x: torch.Tensor, meta: LoRAKernelMeta) -> torch.Tensor:
    y = torch.zeros(x.shape[0], module.out_features, device=x.device, dtype=x.dtype)
    add_lora((module,), x, (y,), meta)
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", ROWS)
def test_auto_down_proj_equals_triton_and_takes_the_extension_up_to_16_rows(num_rows, llama_down, monkeypatch):
    assert cuda_ext.load_lora_bgmv() is not None, cuda_ext.unavailable_reason()
    calls = _spy_cuda(monkeypatch)
    g = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, DOWN_IN, generator=g).to("cuda", torch.bfloat16)
    meta = decode_meta(num_rows, "cuda")
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", "triton")
    want = _bypass(llama_down, x, meta)
    assert calls == []
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", "auto")
    got = _bypass(llama_down, x, meta)
    if num_rows <= 16:
        assert calls == ["lora_shrink_cuda", "lora_expand_cuda"]
        torch.testing.assert_close(got, want, **BF16_TOL)
    else:
        assert calls == []
        assert torch.equal(got, want)  # the same Triton kernels
    assert got.abs().max() > 0.1  # the bypass is not vanishingly small next to the tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [16, 17])
def test_auto_graphs_captured_per_batch_size_replay_their_path(num_rows, llama_down, monkeypatch):
    # A graph is captured once per padded batch size; replayed with new slots it must still equal
    # eager Triton, through the extension at 16 rows and Triton at 17.
    assert cuda_ext.load_lora_bgmv() is not None, cuda_ext.unavailable_reason()
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", "auto")
    calls = _spy_cuda(monkeypatch)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(num_rows, DOWN_IN, generator=g).to("cuda", torch.bfloat16)
    meta = decode_meta(num_rows, "cuda")
    y = torch.zeros(num_rows, DOWN_OUT, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile / warm up outside the capture
        add_lora((llama_down,), x, (y,), meta)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora((llama_down,), x, (y,), meta)
    assert calls == (["lora_shrink_cuda", "lora_expand_cuda"] * 2 if num_rows <= 16 else [])
    new_slots = [-1 if t % 5 == 4 else (3 * t + 1) % NUM_SLOTS for t in range(num_rows)]
    meta.token_slots.copy_(torch.tensor(new_slots, dtype=torch.int32))
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", "triton")
    want = _bypass(llama_down, x, LoRAKernelMeta.build([1] * num_rows, new_slots, "cuda"))
    torch.testing.assert_close(y, want, **BF16_TOL)


@pytest.mark.gpu
def test_engine_loads_the_extension_before_capturing_graphs(tiny_config, tiny_checkpoint, monkeypatch):
    from flexserve import LLM
    from flexserve.worker import model_runner
    from flexserve.worker.cuda_graphs import CUDAGraphRunner

    events = []
    real_load, real_capture = model_runner.load_for_decode, CUDAGraphRunner.capture
    monkeypatch.setattr(model_runner, "load_for_decode",
                        lambda device, **kw: events.append("load") or real_load(device, **kw))
    monkeypatch.setattr(CUDAGraphRunner, "capture", lambda self: events.append("capture") or real_capture(self))
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", "auto")
    model_dir = tiny_checkpoint(tiny_config("llama"), seed=1)
    LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64,
        num_blocks=64, warmup=False)
    assert events == ["load", "capture"]
    assert cuda_ext.cuda_bgmv_available("cuda")

"""The CUDA C++ BGMV decode extension (csrc/lora_bgmv.{cu,cpp}, flexserve_kernels.lora.serve.cuda_ext).

On CPU (CI): the loader declines with a logged reason (CPU torch or no GPU), FLEXSERVE_CUDA_EXT=0
and FLEXSERVE_LORA_DECODE_BACKEND are honored, and the sources compile with this machine's nvcc
(the kernel file for sm_90, with ptxas's spill report, and for sm_80, the path without thread
block clusters) and g++ (the torch binding, syntax only, against the wheel's headers).

On a GPU (marked gpu): the extension builds, its shrink and expand match the torch references in
lora_ref on odd shapes (inputs that are no multiple of the shrink's split chunk or of the 16-byte
vector, one token of down_proj's 14336 inputs), ranks 1..128, rows without an adapter (slot -1 or
past the last slot), several adapters and strided rows; a token's results do not depend on the
rest of its batch (bit for bit); bad inputs raise ValueError; the ops replay inside a CUDA graph;
and a LoRA decode batch through the engine scores the same tokens with the extension as with
Triton. Which backend runs which batch: tests/test_lora_decode_backend.py.

Tolerances: the shrink accumulates x * A in float32 in another order than the reference's float32
matmul (rel 1e-5 on fp32/bf16 inputs, both exact products of the rounded inputs). The expand rounds
y once, y + scaling * s B^T; lora_expand_ref rounds the delta and then the sum, so the expected y
is lora_expand_ref on a float32 copy of y rounded once: the two then differ by float32 summation
order, which can flip the final rounding by one ulp of y.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flexserve_kernels.lora.serve import cuda_ext
from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
from flexserve_kernels.lora.serve.ref import lora_expand_ref, lora_shrink_ref

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


# ------------------------------------------------------------------------------------------- CPU
@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only answer")
def test_loader_declines_without_cuda_and_logs_why(fresh_loader, caplog, monkeypatch):
    monkeypatch.delenv("FLEXSERVE_CUDA_EXT", raising=False)
    expected = ("is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible")
    # INFO under the default backend (auto), WARNING under cuda: tests/test_lora_decode_backend.py
    with caplog.at_level(logging.INFO, logger="flexserve_kernels.lora.serve.cuda_ext"):
        assert cuda_ext.load_lora_bgmv() is None
        assert cuda_ext.load_lora_bgmv() is None
    assert expected in cuda_ext.unavailable_reason()
    messages = [r.getMessage() for r in caplog.records if "CUDA BGMV extension unavailable" in r.getMessage()]
    assert len(messages) == 1 and expected in messages[0]  # logged once for two calls
    assert not cuda_ext.cuda_bgmv_available("cpu")
    assert not cuda_ext.cuda_bgmv_available("cuda")


def test_decode_routing_never_builds_the_extension(fresh_loader, monkeypatch):
    # Only the start-up (`load_for_decode`) builds; a decode-only batch before that runs Triton.
    builds = []
    monkeypatch.setattr(cuda_ext, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cuda_ext, "_build", lambda: builds.append(1))
    monkeypatch.delenv("FLEXSERVE_CUDA_EXT", raising=False)
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", "auto")
    meta = LoRAKernelMeta.build([1, 1], [0, 1], "cpu")
    assert not cuda_ext.cuda_bgmv_loaded("cuda")
    assert not cuda_ext.cuda_decode_wanted("cuda", meta) and builds == []
    monkeypatch.setattr(torch.ops, "flexserve", SimpleNamespace(lora_bgmv_shrink=1,
                                                                lora_bgmv_expand=2), raising=False)
    assert cuda_ext.load_lora_bgmv() is not None and builds == [1]  # the start-up's load
    assert cuda_ext.cuda_bgmv_loaded("cuda") and not cuda_ext.cuda_bgmv_loaded("cpu")
    assert cuda_ext.cuda_decode_wanted("cuda", meta) and builds == [1]


def test_env_switch_turns_the_extension_off(fresh_loader, caplog, monkeypatch):
    monkeypatch.setenv("FLEXSERVE_CUDA_EXT", "0")
    with caplog.at_level(logging.INFO, logger="flexserve_kernels.lora.serve.cuda_ext"):
        assert cuda_ext.load_lora_bgmv() is None
    assert cuda_ext.unavailable_reason() == "FLEXSERVE_CUDA_EXT=0 turns it off"
    assert any("FLEXSERVE_CUDA_EXT=0" in r.getMessage() for r in caplog.records)
    assert not cuda_ext.cuda_bgmv_available("cuda")
    meta = LoRAKernelMeta.build([1, 1], [0, 1], "cpu")
    assert not cuda_ext.cuda_decode_wanted("cuda", meta)
    assert not cuda_ext.cuda_decode_replaces_fused("cuda", meta)


def test_cpu_tensors_never_take_the_extension(monkeypatch):
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", "cuda")
    decode = LoRAKernelMeta.build([1, 1, 1], [0, -1, 2], "cpu")
    assert decode.decode_only
    assert not cuda_ext.cuda_decode_wanted("cpu", decode)


def test_sources_are_found_and_packaged():
    assert sorted(p.name for p in cuda_ext.source_dir().iterdir() if p.suffix in (".cu", ".cpp")) == \
        ["lora_bgmv.cpp", "lora_bgmv.cu"]
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert '"flexserve_kernels.csrc" = "csrc"' in pyproject
    assert '"flexserve_kernels.csrc" = ["*.cu", "*.cpp"]' in pyproject


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_kernel_file_compiles_without_spills(arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    source = cuda_ext.source_dir() / "lora_bgmv.cu"
    # The flags torch.utils.cpp_extension builds it with (no implicit half/bf16 conversions).
    result = subprocess.run([nvcc, *COMMON_NVCC_FLAGS, f"-arch={arch}", "-O3", "-std=c++17", "-Xptxas", "-v",
                             "-c", str(source), "-o", str(tmp_path / "lora_bgmv.o")],
                            capture_output=True, text=True, timeout=300)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-4000:]
    assert "warning" not in report, report[-4000:]
    entries = re.findall(rf"Compiling entry function '(\w+)' for '{arch}'", report)
    # 3 shrink rank tiles x 2 load widths x 3 dtypes; 2 expand output counts x 2 load widths x 3 dtypes.
    assert sum("bgmv_shrink_kernel" in e for e in entries) == 18
    assert sum("bgmv_expand_kernel" in e for e in entries) == 12
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) == 30 and all(a == "0" and b == "0" for a, b in spills), report[-4000:]


def test_binding_compiles_against_the_torch_headers(tmp_path):
    compiler = shutil.which("g++")
    cuda_include = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    if compiler is None or not (cuda_include / "cuda_runtime.h").is_file():
        pytest.skip("needs g++ and the CUDA toolkit's headers")
    from torch.utils.cpp_extension import include_paths

    includes = include_paths()
    if not (Path(includes[0]) / "c10" / "cuda" / "CUDAStream.h").is_file():
        pytest.skip("this torch wheel ships no c10/cuda headers")
    # A CPU wheel lacks the one header its CMake build generates for c10/cuda; its content in CUDA
    # wheels is this define, so the syntax check can still read every other real header.
    shim = tmp_path / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    macros = Path(includes[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    (shim / "cuda_cmake_macros.h").write_text(
        macros.read_text() if macros.is_file() else "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    command = [compiler, "-std=c++20", "-fsyntax-only", "-Wall", "-Werror=return-type",
               *(f"-I{p}" for p in includes), f"-I{tmp_path}", f"-I{cuda_include}",
               str(cuda_ext.source_dir() / "lora_bgmv.cpp")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    own_warnings = [line for line in result.stderr.splitlines() if "lora_bgmv.cpp:" in line and "warning" in line]
    assert result.returncode == 0, result.stderr[-4000:]
    assert own_warnings == []


# ------------------------------------------------------------------------------------------- GPU
def _ops():
    ops = cuda_ext.load_lora_bgmv()
    assert ops is not None, f"the extension did not load: {cuda_ext.unavailable_reason()}"
    return ops


def _case(num_tokens, in_size, out_size, max_rank, num_slots, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # Several adapters and rows without one, mixed: slot -1 every third row.
    row_slots = [-1 if t % 3 == 1 else (t * 5 + seed) % num_slots for t in range(num_tokens)]
    meta = LoRAKernelMeta.build([1] * num_tokens, row_slots, "cuda")
    x = torch.randn(num_tokens, in_size, generator=g).to("cuda", dtype)
    lora_a = (torch.randn(num_slots, max_rank, in_size, generator=g) / in_size**0.5).to("cuda", dtype)
    lora_b = torch.randn(num_slots, out_size, max_rank, generator=g).to("cuda", dtype)
    scaling = (torch.rand(num_slots, generator=g) + 0.5).to("cuda")
    y = torch.randn(num_tokens, out_size, generator=g).to("cuda", dtype)
    return meta, x, lora_a, lora_b, scaling, y


def _expand_expected(s, lora_b, meta, y, scaling):
    """lora_expand_ref on a float32 copy of y, rounded once to y's dtype as the kernel rounds."""
    return lora_expand_ref(s, lora_b, meta, y.float(), scaling).to(y.dtype)


SHAPES = [  # (tokens, in, out, max_rank, slots): odd sizes take the unvectorized kernels
    (1, 4096, 1024, 16, 8), (7, 4095, 513, 7, 3), (33, 14336, 4096, 16, 8), (64, 4096, 14336, 64, 8),
    (5, 96, 40, 1, 2), (17, 1000, 3000, 33, 4),
    # tokens x rank tiles of 16 >= 1.5 x 132 SMs: the wide rank tile, vectorized and not
    (300, 1024, 256, 16, 8), (70, 999, 100, 64, 5),
    # down_proj's input for one token (8 chunks of 1792, rank tile 1); 14337 splits unvectorized
    (1, 14336, 4096, 16, 8), (3, 14337, 4096, 16, 8),
    # chunks that are no multiple of 128 vectors; ranks 1, 33 (a partial tile and chunk) and 128
    (2, 3000, 700, 1, 3), (5, 5000, 1000, 33, 4), (9, 4096, 1024, 128, 2), (64, 14336, 1024, 128, 8),
]
# (atol, rtol) on y: one ulp of y (bf16 2**-7, fp16 2**-10 relative) for a rounding that flips
TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}


@gpu
def test_extension_builds_and_registers_ops():
    ops = _ops()
    assert ops.shrink is torch.ops.flexserve.lora_bgmv_shrink
    assert ops.expand is torch.ops.flexserve.lora_bgmv_expand
    assert cuda_ext.cuda_bgmv_available("cuda")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-in{s[1]}-out{s[2]}-r{s[3]}" for s in SHAPES])
def test_shrink_and_expand_match_reference(shape, dtype):
    ops = _ops()
    meta, x, lora_a, lora_b, scaling, y = _case(*shape, dtype, seed=sum(shape))
    s = torch.full((x.shape[0], lora_a.shape[1]), float("nan"), device="cuda")
    ops.shrink(x, lora_a, meta.token_slots, s)
    expected_s = lora_shrink_ref(x, lora_a, meta)
    torch.testing.assert_close(s, expected_s, atol=2e-4, rtol=1e-5)
    assert (s[meta.token_slots < 0] == 0).all()  # rows without adapter are written as zeros

    expected_y = _expand_expected(s, lora_b, meta, y, scaling)  # the expand alone, from the kernel's s
    base = y.clone()
    ops.expand(s, lora_b, meta.token_slots, scaling, y)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y, expected_y, atol=atol, rtol=rtol)
    no_adapter = meta.token_slots < 0
    assert torch.equal(y[no_adapter], base[no_adapter])  # untouched, bit for bit


@gpu
def test_expand_into_a_column_slice_leaves_other_columns():
    ops = _ops()
    meta, x, lora_a, lora_b, scaling, _ = _case(9, 512, 384, 16, 4, torch.bfloat16, seed=3)
    wide = torch.randn(9, 1024, device="cuda", dtype=torch.bfloat16)
    before = wide.clone()
    y = wide[:, 256:640]  # row stride 1024, offset 256 elements: still 16-byte aligned rows
    s = torch.empty(9, 16, device="cuda")
    ops.shrink(x, lora_a, meta.token_slots, s)
    expected = _expand_expected(s, lora_b, meta, y, scaling)
    ops.expand(s, lora_b, meta.token_slots, scaling, y)
    torch.testing.assert_close(wide[:, 256:640], expected, atol=2e-2, rtol=1.6e-2)
    assert torch.equal(wide[:, :256], before[:, :256]) and torch.equal(wide[:, 640:], before[:, 640:])


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("in_size", [14339, 4102, 77])
def test_strided_rows_with_a_tail_past_the_last_vector(in_size, dtype):
    # x, lora_a and y are column slices of padded tensors: rows 16-byte aligned (the vectorized
    # kernels) while in_size is no multiple of the vector, so the last chunk takes a scalar tail.
    _ops()
    meta, x, lora_a, lora_b, scaling, y = _case(6, in_size, 520, 16, 4, dtype, seed=in_size)
    row = (in_size + 7) // 8 * 8 + 8  # a whole number of 16-byte vectors in every dtype
    x_wide = torch.zeros(6, row, device="cuda", dtype=dtype)
    x_wide[:, :in_size] = x
    a_wide = torch.zeros(4, 16, row, device="cuda", dtype=dtype)
    a_wide[..., :in_size] = lora_a
    y_wide = torch.randn(6, 1024, device="cuda", dtype=dtype)
    y_wide[:, 256:776] = y
    x_view, a_view, y_view = x_wide[:, :in_size], a_wide[..., :in_size], y_wide[:, 256:776]
    assert x_view.stride(0) == row and a_view.stride(1) == row and in_size % 4 != 0
    s = cuda_ext.lora_shrink_cuda(x_view, a_view, meta.token_slots)
    torch.testing.assert_close(s, lora_shrink_ref(x, lora_a, meta), atol=2e-4, rtol=1e-5)
    before = y_wide.clone()
    expected = _expand_expected(s, lora_b, meta, y, scaling)
    cuda_ext.lora_expand_cuda(s, lora_b, meta.token_slots, y_view, scaling)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y_wide[:, 256:776], expected, atol=atol, rtol=rtol)
    assert torch.equal(y_wide[:, :256], before[:, :256]) and torch.equal(y_wide[:, 776:], before[:, 776:])


@gpu
@pytest.mark.parametrize("in_size", [14336, 4096])
def test_rows_without_adapter_on_the_split_path(in_size):
    # Slot -1 and a slot past the last one: s's row is zero, y's row untouched (one token, and one
    # token among several, so every rank tile and chunk of the split grid meets such a row).
    ops = _ops()
    for slots in ([-1], [4], [2, -1, 4, 0]):
        meta, x, lora_a, lora_b, scaling, y = _case(len(slots), in_size, 4096, 16, 4, torch.bfloat16, seed=7)
        token_slots = torch.tensor(slots, dtype=torch.int32, device="cuda")
        s = torch.full((len(slots), 16), float("nan"), device="cuda")
        ops.shrink(x, lora_a, token_slots, s)
        base = y.clone()
        ops.expand(s, lora_b, token_slots, scaling, y)
        for t, slot in enumerate(slots):
            if 0 <= slot < 4:
                row_meta = LoRAKernelMeta.build([1], [slot], "cuda")
                torch.testing.assert_close(s[t : t + 1], lora_shrink_ref(x[t : t + 1], lora_a, row_meta),
                                           atol=2e-4, rtol=1e-5)
                assert not torch.equal(y[t], base[t])
            else:
                assert torch.equal(s[t], torch.zeros(16, device="cuda"))
                assert torch.equal(y[t], base[t])


@gpu
@pytest.mark.parametrize("shape", [(64, 14336, 4096, 16, 8), (48, 4096, 1024, 33, 5), (40, 3000, 700, 128, 3)],
                         ids=["down", "r33", "r128"])
def test_a_tokens_results_do_not_depend_on_its_batch(shape):
    # The shrink's split of `in` follows in_size alone and its rank tile (picked from the batch)
    # changes no rank's order of summation; the expand's order follows the rank alone. So a token
    # alone gets the same bits as inside a batch of 40-64 (different rank tiles and output counts).
    ops = _ops()
    meta, x, lora_a, lora_b, scaling, y = _case(*shape, torch.bfloat16, seed=13)
    num_tokens, max_rank = shape[0], shape[3]
    s = torch.empty(num_tokens, max_rank, device="cuda")
    ops.shrink(x, lora_a, meta.token_slots, s)
    y_batch = y.clone()
    ops.expand(s, lora_b, meta.token_slots, scaling, y_batch)
    for t in (0, 2, num_tokens - 1):
        s_one = torch.empty(1, max_rank, device="cuda")
        ops.shrink(x[t : t + 1], lora_a, meta.token_slots[t : t + 1], s_one)
        y_one = y[t : t + 1].clone()
        ops.expand(s_one, lora_b, meta.token_slots[t : t + 1], scaling, y_one)
        assert torch.equal(s_one[0], s[t]) and torch.equal(y_one[0], y_batch[t])


@gpu
def test_bad_inputs_raise_value_error():
    # Through the Python wrappers: the C++ ops' own ValueErrors crashed the process on the H200
    # (torch 2.11; segmentation fault on the first one), so the wrappers check first.
    _ops()
    meta, x, lora_a, lora_b, scaling, y = _case(4, 256, 128, 8, 2, torch.bfloat16, seed=1)
    slots = meta.token_slots
    with pytest.raises(ValueError, match="does not take x"):
        cuda_ext.lora_shrink_cuda(x, lora_a.float(), slots)
    with pytest.raises(ValueError, match="does not take x"):
        cuda_ext.lora_shrink_cuda(x[:, :128], lora_a, slots)
    with pytest.raises(ValueError, match="token_slots must be a CUDA int32"):
        cuda_ext.lora_shrink_cuda(x, lora_a, slots.long())
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        cuda_ext.lora_shrink_cuda(x.cpu(), lora_a, slots)
    s = cuda_ext.lora_shrink_cuda(x, lora_a, slots)
    with pytest.raises(ValueError, match="one scaling per slot"):
        cuda_ext.lora_expand_cuda(s, lora_b, slots, y, torch.ones(3, device="cuda"))
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        cuda_ext.lora_expand_cuda(s, lora_b, slots, y.t().contiguous().t(), scaling)
    with pytest.raises(ValueError, match="one scaling per slot"):
        cuda_ext.lora_expand_cuda(s.bfloat16(), lora_b, slots, y, scaling)


@gpu
def test_ops_replay_in_a_cuda_graph():
    ops = _ops()
    meta, x, lora_a, lora_b, scaling, y = _case(16, 4096, 1024, 16, 8, torch.bfloat16, seed=11)
    token_slots = meta.token_slots.clone()
    s = torch.empty(16, 16, device="cuda")
    out = y.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        ops.shrink(x, lora_a, token_slots, s)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.shrink(x, lora_a, token_slots, s)
        ops.expand(s, lora_b, token_slots, scaling, out)
    # New routing after capture: the graph reads token_slots from the same buffer.
    new_slots = [(t * 3) % 8 if t % 4 else -1 for t in range(16)]
    token_slots.copy_(torch.tensor(new_slots, dtype=torch.int32))
    out.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    new_meta = LoRAKernelMeta.build([1] * 16, new_slots, "cuda")
    expected = _expand_expected(lora_shrink_ref(x, lora_a, new_meta), lora_b, new_meta, y, scaling)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=1.6e-2)


@gpu
@pytest.mark.parametrize("backend", ["auto", "cuda"])
def test_lora_ops_route_decode_batches_to_the_extension(backend, monkeypatch):
    from flexserve_kernels.lora.serve import ops as lora_ops

    _ops()
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", backend)
    calls = []
    for name in ("lora_shrink_cuda", "lora_expand_cuda"):
        real = getattr(cuda_ext, name)
        monkeypatch.setattr(cuda_ext, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    meta, x, lora_a, lora_b, scaling, y = _case(12, 4096, 1024, 16, 8, torch.bfloat16, seed=5)
    expected = _expand_expected(lora_shrink_ref(x, lora_a, meta), lora_b, meta, y, scaling)
    lora_ops.lora_expand(lora_ops.lora_shrink(x, lora_a, meta), lora_b, meta, y, scaling)
    assert calls == ["lora_shrink_cuda", "lora_expand_cuda"]
    torch.testing.assert_close(y, expected, atol=2e-2, rtol=1.6e-2)
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", "triton")
    lora_ops.lora_shrink(x, lora_a, meta)
    assert calls == ["lora_shrink_cuda", "lora_expand_cuda"]  # Triton now


# --------------------------------------------------------------------------------- model level
MODEL = "llama-3.1-8b"
# Random dummy weights leave near-ties; as in test_gpu_fast_path, the extension's generation is
# scored teacher-forced by the Triton path: every generated token's logprob must agree within
# LOGPROB_ATOL and lie within MARGIN of Triton's argmax. Besides the float32 summation order of
# the LoRA shrink, the generation is decode (one token a step, CUDA graphs) and the scoring a
# bf16 prefill, so the argmax must agree at almost every position and the logprobs within a few
# bf16 ulps. Random weights make the distributions flat (top logprobs around -7), so greedy
# decoding meets near-ties: measured on the H200, logprob gaps up to 0.125 and chosen tokens up
# to 0.156 below the prefill's argmax, so both bounds are 0.25.
# The same check of Triton's own decode against its prefill (backend "triton", the baseline)
# agrees at 108/120 positions on the H200; the extension at 109 (cuda) and 113 (auto).
LOGPROB_ATOL = 0.25
MARGIN = 0.25
ARGMAX_SHARE = 0.85


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory):
    from flexserve import LLM
    from flexserve.model.registry import resolve_model
    from flexserve.peft.bypass import target_shapes
    from flexserve.peft.lora import LoRAAdapter
    from flexserve.peft.peft_io import save_peft_adapter

    config = resolve_model(MODEL, "dummy").hf_config
    paths = []
    for i in range(3):
        g = torch.Generator().manual_seed(100 + i)
        adapter = LoRAAdapter.create(
            target_shapes(config), config.num_hidden_layers, rank=16, lora_alpha=32,
            target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            generator=g)
        for _, b in adapter.weights.values():
            b.normal_(0, 0.02, generator=g)
        path = tmp_path_factory.mktemp(f"lora{i}")
        save_peft_adapter(adapter, str(path))
        paths.append(str(path))
    llm = LLM(MODEL, load_format="dummy", dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.5,
              max_num_seqs=16, enable_lora=True, max_loras=4, max_lora_rank=16, enforce_eager=True)
    return llm, paths


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "auto", "cuda"])
def test_lora_decode_tokens_match_triton(lora_engine, backend, monkeypatch):
    from flexserve import LoRARequest, SamplingParams

    _ops()
    llm, paths = lora_engine
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(100, 128000, (int(n),), generator=g).tolist()
             for n in torch.randint(5, 60, (8,), generator=g)]
    adapters = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    requests = [None if i % 4 == 3 else adapters[i % 3] for i in range(len(batch))]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True)
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", backend)
    ours = llm.generate(batch, greedy, use_tqdm=False, lora_request=requests)
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", "triton")
    extended = [p + o.outputs[0].token_ids[:-1] for p, o in zip(batch, ours)]
    scored = llm.generate(extended, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False, lora_request=requests)
    same = total = 0
    for prompt, out, ref in zip(batch, ours, scored):
        completion = out.outputs[0]
        for j, token in enumerate(completion.token_ids[:-1]):
            position = ref.prompt_logprobs[len(prompt) + j]
            theirs, ours_lp = position[token].logprob, completion.logprobs[j][token].logprob
            best = max(lp.logprob for lp in position.values())
            assert abs(ours_lp - theirs) < LOGPROB_ATOL, f"position {j}: {ours_lp:.4f} vs Triton {theirs:.4f}"
            assert best - theirs < MARGIN, f"position {j}: token {token} is {best - theirs:.3f} below Triton's argmax"
            same += int(best == theirs)
            total += 1
    assert total == 8 * 15
    assert same / total >= ARGMAX_SHARE, f"identical argmax at {same}/{total} positions"

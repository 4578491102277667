"""Segmented LoRA kernels (SGMV and BGMV shrink/expand) and their dispatch vs the torch references.

Without CUDA the kernels run on CPU under Triton's interpreter. Triton (3.9) reads TRITON_INTERPRET
when it decorates a jit function, its own library's included (tl.zeros is one, decorated when
triton is first imported), and again when a kernel first launches (lazy imports). So this module
sets it around importing triton and the kernels, and through an autouse fixture around each test;
it never leaves it set for other modules, whose CPU LoRA layers would otherwise crawl through the
interpreter. If another module imported triton first, this module reruns itself in a child
process with TRITON_INTERPRET=1. With CUDA the same small cases run compiled on the GPU, plus the
Llama-3.1-8B-shaped bf16/fp16 tests. Either way the kernels are also compiled for sm_90 with the
wheel's ptxas (no GPU needed) to catch compile errors and register spills.

What each op writes (checked below): the shrink returns a new float32 s with every row written,
zero for tokens without an adapter; the expand touches only the rows of y whose token has an
adapter and never reads s or y elsewhere (poisoned with NaN here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from flexserve_kernels.lora.serve.meta import LoRAKernelMeta
from flexserve_kernels.lora.serve.ref import lora_expand_ref, lora_shrink_ref

from _triton_interpret import (
    compile_for_hopper,
    import_kernels,
    interpreter_hooks,
    is_interpreted,
    library_is_compiled,
)

_KERNEL_MODULES = ("flexserve_kernels.lora.serve.shrink", "flexserve_kernels.lora.serve.expand")


shrink_kernels, expand_kernels = import_kernels(_KERNEL_MODULES, interpret=not torch.cuda.is_available())
from flexserve_kernels.lora.serve import ops as lora_ops  # noqa: E402  (after the kernels are decorated)

INTERPRETED = is_interpreted(shrink_kernels._lora_shrink_sgmv_kernel)
# Interpreted kernels run on CPU tensors; compiled ones on the GPU (the lead's CI for this file).
DEVICE = "cpu" if INTERPRETED else "cuda"
VARIANTS = [None, "sgmv", "bgmv"]
# Another module imported Triton first, outside the interpreter: its library cannot run
# interpreted in this process, so the whole module runs in a child process instead.
RUN_IN_CHILD = INTERPRETED and library_is_compiled()


test_module_in_interpreter_child_process, _triton_interpret = interpreter_hooks(
    __file__, INTERPRETED, RUN_IN_CHILD)


@dataclass(frozen=True)
class Case:
    hidden_size: int  # x's last dimension (the shrink's K)
    out_size: int  # y's last dimension
    max_rank: int  # slot width; adapters of smaller rank are zero-padded
    slot_ranks: tuple[int, ...]  # true rank of the adapter in each slot
    row_lens: tuple[int, ...]  # tokens per row of the flat batch
    row_slots: tuple[int, ...]  # slot of each row, -1 = base model

    @property
    def num_tokens(self) -> int:
        return sum(self.row_lens)


CASES = {
    # Rank 1 (dot dimension padded 1 -> 16), sizes prime to every block.
    "r1-h33-o45": Case(33, 45, 1, (1, 1), (1, 17, 2, 1), (0, 1, -1, 0)),
    # Rows (3, 1) of slot 1 are adjacent and merge into one segment.
    "r7-h100-o77": Case(100, 77, 7, (7, 3, 5), (5, 1, 17, 3, 1), (-1, 2, 0, 1, 1)),
    # SmolLM2's hidden size; a 130-token segment spans three 64-token tiles.
    "r16-h576-o200": Case(576, 200, 16, (16, 8), (130, 1, 17, 1, 2), (0, -1, 1, 0, -1)),
    "r64-h100-o130": Case(100, 130, 64, (64, 7, 33), (1, 40, 1, 1), (2, 0, -1, 1)),
    # Rank 128: one 128-wide shrink tile, two 64-wide expand steps.
    "r128-h48-o40": Case(48, 40, 128, (128, 100), (20, 2, 1), (1, 0, -1)),
    # One-token rows whose neighbours differ: decode_only, the BGMV batch.
    "decode-r16-h100": Case(100, 70, 16, (16, 4, 9), (1,) * 12, (0, 1, -1, 2, 0, -1, 1, 2, 0, 2, -1, 1)),
}


def make_inputs(case: Case, dtype: torch.dtype = torch.float32, device: str = DEVICE, seed: int = 0):
    """x, lora_a, lora_b, y, scaling, meta; unit-scale s and deltas so errors read as relative."""
    g = torch.Generator().manual_seed(seed)
    num_slots = len(case.slot_ranks)
    lora_a = torch.zeros(num_slots, case.max_rank, case.hidden_size)
    lora_b = torch.zeros(num_slots, case.out_size, case.max_rank)
    for slot, rank in enumerate(case.slot_ranks):
        lora_a[slot, :rank] = torch.randn(rank, case.hidden_size, generator=g) / math.sqrt(case.hidden_size)
        lora_b[slot, :, :rank] = torch.randn(case.out_size, rank, generator=g) / math.sqrt(rank)
    x = torch.randn(case.num_tokens, case.hidden_size, generator=g)
    y = torch.randn(case.num_tokens, case.out_size, generator=g)
    scaling = torch.rand(num_slots, generator=g) + 0.5
    meta = LoRAKernelMeta.build(list(case.row_lens), list(case.row_slots), device)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(x), to(lora_a), to(lora_b), to(y), scaling.to(device), meta


def base_rows(meta: LoRAKernelMeta) -> torch.Tensor:
    return meta.token_slots < 0


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double().cpu()
    return ((actual.double().cpu() - expected).norm() / expected.norm()).item()


# ----------------------------------------------------------------------------- float32, odd shapes


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty hands out NaN-filled floating tensors, so any output row a kernel skips shows."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case_id", sorted(CASES))
def test_shrink_matches_reference(case_id, variant, nan_empty):
    x, lora_a, _, _, _, meta = make_inputs(CASES[case_id])
    s = lora_ops.lora_shrink(x, lora_a, meta, variant=variant)
    assert s.dtype == torch.float32 and s.shape == (meta.num_tokens, lora_a.shape[1])
    torch.testing.assert_close(s, lora_shrink_ref(x, lora_a, meta), atol=2e-5, rtol=1e-5)
    assert torch.equal(s[base_rows(meta)], torch.zeros_like(s[base_rows(meta)]))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case_id", sorted(CASES))
def test_expand_matches_reference_and_touches_only_adapter_rows(case_id, variant):
    case = CASES[case_id]
    x, lora_a, lora_b, y0, scaling, meta = make_inputs(case)
    s = lora_shrink_ref(x, lora_a, meta)
    expected = lora_expand_ref(s, lora_b, meta, y0.clone(), scaling)
    base = base_rows(meta)
    # y is a column slice of a wider output (as in a fused qkv projection): rows have stride 7 + out.
    wide = torch.randn(meta.num_tokens, case.out_size + 7, device=DEVICE)
    y = wide[:, 3 : 3 + case.out_size]
    y.copy_(y0)
    y[base] = float("nan")
    s[base] = float("nan")
    before = wide.clone()

    out = lora_ops.lora_expand(s, lora_b, meta, y, scaling, variant=variant)
    assert out is y
    torch.testing.assert_close(y[~base], expected[~base], atol=2e-5, rtol=1e-5)
    assert torch.isnan(y[base]).all()
    outside = torch.ones(wide.shape[1], dtype=torch.bool)
    outside[3 : 3 + case.out_size] = False
    assert torch.equal(wide[:, outside], before[:, outside])


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_padded_ranks_match_unpadded_adapters(variant):
    # Each slot's adapter computed alone at its true rank: padding to max_rank changes nothing.
    case = CASES["r64-h100-o130"]
    x, lora_a, lora_b, y0, scaling, meta = make_inputs(case)
    y = lora_ops.lora_expand(lora_ops.lora_shrink(x, lora_a, meta, variant=variant), lora_b, meta, y0.clone(),
                             scaling, variant=variant)
    expected = y0.clone()
    for token, slot in enumerate(meta.token_slots.tolist()):
        if slot >= 0:
            rank = case.slot_ranks[slot]
            expected[token] += scaling[slot] * (lora_b[slot, :, :rank] @ (lora_a[slot, :rank] @ x[token]))
    torch.testing.assert_close(y, expected, atol=3e-5, rtol=1e-5)


def test_sgmv_shrink_split_k_and_small_blocks(nan_empty):
    x, lora_a, _, _, _, meta = make_inputs(CASES["r7-h100-o77"])
    expected = lora_shrink_ref(x, lora_a, meta)
    for split_k in (1, 2, 5):  # 5 splits of 100 in 16-wide steps become 4 of 32: none empty
        s = shrink_kernels.lora_shrink_sgmv(x, lora_a, meta, block_m=16, block_k=16, split_k=split_k)
        torch.testing.assert_close(s, expected, atol=2e-5, rtol=1e-5)
        assert torch.equal(s[base_rows(meta)], torch.zeros_like(s[base_rows(meta)]))


def tile_mapped(meta: LoRAKernelMeta, block_m: int, pad_segments: int, num_entries: int):
    """The CUDA-graph form of `meta`: empty segments appended, a static max_seg_len (all tokens)
    and a tile map of `num_entries` (more than the tiles) over the real segments."""
    from flexserve_kernels.lora.serve.meta import segment_tile_map

    zeros = meta.seg_lens.new_zeros(pad_segments)
    lens = meta.seg_lens.cpu().numpy()
    tile_map = torch.from_numpy(segment_tile_map(lens, block_m, num_entries)).to(meta.seg_lens.device)
    return LoRAKernelMeta(
        token_slots=meta.token_slots, seg_starts=torch.cat([meta.seg_starts, zeros]),
        seg_lens=torch.cat([meta.seg_lens, zeros]), seg_slots=torch.cat([meta.seg_slots, zeros]),
        num_tokens=meta.num_tokens, max_seg_len=meta.num_tokens, decode_only=False,
        tile_map=tile_map, tile_block_m=block_m)


@pytest.mark.parametrize("case_id", ["r7-h100-o77", "r16-h576-o200", "r64-h100-o130"])
def test_sgmv_tile_map_with_padding_segments(case_id, nan_empty):
    case = CASES[case_id]
    x, lora_a, lora_b, y0, scaling, meta = make_inputs(case)
    mapped = tile_mapped(meta, block_m=16, pad_segments=3, num_entries=40)
    expected_s = lora_shrink_ref(x, lora_a, meta)
    s = shrink_kernels.lora_shrink_sgmv(x, lora_a, mapped)
    torch.testing.assert_close(s, expected_s, atol=2e-5, rtol=1e-5)
    assert torch.equal(s[base_rows(meta)], torch.zeros_like(s[base_rows(meta)]))
    expected_y = lora_expand_ref(expected_s, lora_b, meta, y0.clone(), scaling)
    y = expand_kernels.lora_expand_sgmv(expected_s, lora_b, mapped, y0.clone(), scaling)
    torch.testing.assert_close(y, expected_y, atol=2e-5, rtol=1e-5)


def test_small_blocks_loop_over_tails():
    # Every loop takes several steps, most end in a masked tail: K 100 in 16s or 32s, ranks 64 and
    # 40 in 16s (loop steps in the expands, rank tiles in the BGMV shrink), outputs 130 in 32s or
    # 64s, a 40-token segment in 16s.
    x, lora_a, lora_b, y0, scaling, meta = make_inputs(CASES["r64-h100-o130"])
    s_ref = lora_shrink_ref(x, lora_a, meta)
    y_ref = lora_expand_ref(s_ref, lora_b, meta, y0.clone(), scaling)
    tol = dict(atol=2e-5, rtol=1e-5)
    s = shrink_kernels.lora_shrink_sgmv(x, lora_a, meta, block_m=16, block_k=16)
    torch.testing.assert_close(s, s_ref, **tol)
    s = shrink_kernels.lora_shrink_bgmv(x, lora_a, meta, block_r=16, block_k=32)
    torch.testing.assert_close(s, s_ref, **tol)
    y = expand_kernels.lora_expand_sgmv(s_ref, lora_b, meta, y0.clone(), scaling, block_m=16, block_n=32, block_r=16)
    torch.testing.assert_close(y, y_ref, **tol)
    y = expand_kernels.lora_expand_bgmv(s_ref, lora_b, meta, y0.clone(), scaling, block_n=32, block_r=16)
    torch.testing.assert_close(y, y_ref, **tol)
    a40, s40, b40 = lora_a[:, :40].contiguous(), s_ref[:, :40].contiguous(), lora_b[:, :, :40].contiguous()
    s = shrink_kernels.lora_shrink_bgmv(x, a40, meta, block_r=16, block_k=32)
    torch.testing.assert_close(s, lora_shrink_ref(x, a40, meta), **tol)
    y40_ref = lora_expand_ref(s40, b40, meta, y0.clone(), scaling)
    y = expand_kernels.lora_expand_sgmv(s40, b40, meta, y0.clone(), scaling, block_n=64, block_r=16)
    torch.testing.assert_close(y, y40_ref, **tol)
    y = expand_kernels.lora_expand_bgmv(s40, b40, meta, y0.clone(), scaling, block_n=64, block_r=16)
    torch.testing.assert_close(y, y40_ref, **tol)


def test_bgmv_one_rank_row_per_program():
    x, lora_a, _, _, _, meta = make_inputs(CASES["r1-h33-o45"])
    s = shrink_kernels.lora_shrink_bgmv(x, lora_a, meta, block_r=1, block_k=16)
    torch.testing.assert_close(s, lora_shrink_ref(x, lora_a, meta), atol=2e-5, rtol=1e-5)


# -------------------------------------------------------------------------------- half precision

# Relative L2 error vs the float32 reference on the same 16-bit inputs. The shrink's products are
# exact in float32, so only summation order differs; the expand rounds s to the weights' dtype for
# the dot and y once at the end.
SHRINK_TOL = {torch.float16: 1e-4, torch.bfloat16: 1e-4}
EXPAND_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("variant", ["sgmv", "bgmv"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_matches_float32_reference(dtype, variant):
    if INTERPRETED and dtype == torch.bfloat16 and variant == "sgmv":
        # The interpreter multiplies bfloat16 bit patterns in tl.dot (triton-lang/triton#11584,
        # "we just don't support it yet"); the GPU run covers this pair.
        pytest.skip("Triton's interpreter has no bfloat16 tl.dot")
    x, lora_a, lora_b, y0, scaling, meta = make_inputs(CASES["r16-h576-o200"], dtype=dtype)
    s = lora_ops.lora_shrink(x, lora_a, meta, variant=variant)
    s_ref = lora_shrink_ref(x, lora_a, meta)
    assert rel_l2(s, s_ref) < SHRINK_TOL[dtype]
    y = lora_ops.lora_expand(s, lora_b, meta, y0.clone(), scaling, variant=variant)
    y_ref = lora_expand_ref(s_ref, lora_b, meta, y0.float(), scaling)
    assert rel_l2(y, y_ref) < EXPAND_TOL[dtype]
    assert torch.equal(y[base_rows(meta)], y0[base_rows(meta)])


# ------------------------------------------------------------------------------------- dispatch


@pytest.fixture
def launches(monkeypatch):
    """Records the Triton launchers lora_ops calls, by name (Triton only: the CUDA BGMV extension
    would take small decode batches under the default FLEXSERVE_LORA_DECODE_BACKEND)."""
    monkeypatch.setenv("FLEXSERVE_LORA_DECODE_BACKEND", "triton")
    calls: list[str] = []

    def spy(name, launcher):
        def launch(*args, **kwargs):
            calls.append(name)
            return launcher(*args, **kwargs)

        return launch

    for module, names in ((shrink_kernels, ("lora_shrink_sgmv", "lora_shrink_bgmv")),
                          (expand_kernels, ("lora_expand_sgmv", "lora_expand_bgmv"))):
        for name in names:
            monkeypatch.setattr(module, name, spy(name, getattr(module, name)))
    return calls


def test_dispatch_bgmv_for_decode_and_small_batches_sgmv_for_segments(launches):
    small = Case(40, 24, 4, (4,), (3, 5, 1), (0, 0, -1))  # one 8-token segment, 9 tokens
    large = Case(40, 24, 4, (4, 4), (lora_ops.BGMV_MAX_TOKENS, 1), (0, 1))  # just over the limit
    for case, expected in ((CASES["decode-r16-h100"], "bgmv"), (small, "bgmv"), (large, "sgmv")):
        x, lora_a, lora_b, y, scaling, meta = make_inputs(case)
        assert meta.decode_only == (case is CASES["decode-r16-h100"])
        expected_y = lora_expand_ref(lora_shrink_ref(x, lora_a, meta), lora_b, meta, y.clone(), scaling)
        lora_ops.lora_expand(lora_ops.lora_shrink(x, lora_a, meta), lora_b, meta, y, scaling)
        assert launches == [f"lora_shrink_{expected}", f"lora_expand_{expected}"]
        torch.testing.assert_close(y, expected_y, atol=2e-5, rtol=1e-5)
        launches.clear()


def test_batch_without_adapters_launches_nothing(launches):
    case = Case(33, 45, 8, (8, 8), (3, 1, 2), (-1, -1, -1))
    x, lora_a, lora_b, y, scaling, meta = make_inputs(case)
    assert not meta.has_lora and meta.num_segments == 0
    y_before = y.clone()
    for variant in VARIANTS:
        s = lora_ops.lora_shrink(x, lora_a, meta, variant=variant)
        assert s.shape == (6, 8) and s.dtype == torch.float32 and not s.any()
        assert lora_ops.lora_expand(s, lora_b, meta, y, scaling, variant=variant) is y
    assert torch.equal(y, y_before)
    assert launches == []


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path")
def test_cpu_without_interpreter_uses_reference(monkeypatch, launches):
    monkeypatch.delenv("TRITON_INTERPRET")
    x, lora_a, lora_b, y, scaling, meta = make_inputs(CASES["r7-h100-o77"])
    s = lora_ops.lora_shrink(x, lora_a, meta)
    assert torch.equal(s, lora_shrink_ref(x, lora_a, meta))
    expected = lora_expand_ref(s, lora_b, meta, y.clone(), scaling)
    assert torch.equal(lora_ops.lora_expand(s, lora_b, meta, y, scaling), expected)
    assert launches == []


# ----------------------------------------------------------------------------------- bad inputs


def _bad_shrink_inputs():
    x, lora_a, _, _, _, meta = make_inputs(CASES["r7-h100-o77"])
    return {
        "hidden size": (dict(x=x[:, :99]), "hidden size 99"),
        "token count": (dict(x=x[:-1]), "tokens in the tensor"),
        "rank-2 lora_a": (dict(lora_a=lora_a[0]), "lora_a \\[num_slots, max_rank, in\\]"),
        "dtype": (dict(lora_a=lora_a.double()), "one dtype"),
        "int x": (dict(x=x.to(torch.int32), lora_a=lora_a.to(torch.int32)), "one dtype"),
        "strided x": (dict(x=torch.randn(100, x.shape[0], device=DEVICE).T), "contiguous in its last"),
        "strided lora_a": (dict(lora_a=lora_a.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous in its last"),
        "variant": (dict(variant="cutlass"), "variant must be"),
    }, dict(x=x, lora_a=lora_a, meta=meta)


@pytest.mark.parametrize("which", sorted(_bad_shrink_inputs()[0]))
def test_shrink_rejects_bad_inputs(which):
    bad, args = _bad_shrink_inputs()
    override, message = bad[which]
    with pytest.raises(ValueError, match=message):
        lora_ops.lora_shrink(**{**args, **override})


def _bad_expand_inputs():
    x, lora_a, lora_b, y, scaling, meta = make_inputs(CASES["r7-h100-o77"])
    s = lora_shrink_ref(x, lora_a, meta)
    return {
        "rank": (dict(s=s[:, :6]), "max_rank 7"),
        "out size": (dict(y=y[:, :76]), "output size 77"),
        "token count": (dict(s=s[:-1]), "has 26 tokens but y has 27"),
        "scaling size": (dict(scaling=scaling[:2]), "2 entries for 3 slots"),
        "scaling dtype": (dict(scaling=scaling.double()), "scaling must be float32"),
        "y dtype": (dict(y=y.half()), "one dtype"),
        "s dtype": (dict(s=s.half()), "s must be float32"),
        "strided y": (dict(y=torch.randn(77, y.shape[0], device=DEVICE).T), "contiguous in its last"),
        "strided lora_b": (dict(lora_b=lora_b.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous in its last"),
        "1-d y": (dict(y=y[0]), "y \\[T, out\\]"),
    }, dict(s=s, lora_b=lora_b, meta=meta, y=y, scaling=scaling)


@pytest.mark.parametrize("which", sorted(_bad_expand_inputs()[0]))
def test_expand_rejects_bad_inputs(which):
    bad, args = _bad_expand_inputs()
    override, message = bad[which]
    with pytest.raises(ValueError, match=message):
        lora_ops.lora_expand(**{**args, **override})


def test_launchers_reject_bad_block_sizes():
    x, lora_a, lora_b, y, scaling, meta = make_inputs(CASES["r7-h100-o77"])
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        shrink_kernels.lora_shrink_sgmv(x, lora_a, meta, block_m=8)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        shrink_kernels.lora_shrink_bgmv(x, lora_a, meta, block_k=48)
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        shrink_kernels.lora_shrink_sgmv(x, lora_a, meta, split_k=0)
    with pytest.raises(ValueError, match="block_r must be a power of two >= 16"):
        expand_kernels.lora_expand_sgmv(lora_shrink_ref(x, lora_a, meta), lora_b, meta, y, scaling, block_r=8)


# ------------------------------------------------------------------- compiled for Hopper, no GPU

# Compiles the kernels (not interpreted: a fresh process without TRITON_INTERPRET) for sm_90 with
# the ptxas that ships in the triton wheel, for the configurations the launchers pick on
# Llama-3.1-8B shapes, and fails on a compile error or on register spills. The interpreter cannot
# catch either; this needs no GPU.
_COMPILE_SCRIPT = r"""
import triton
from triton.compiler import ASTSource
from flexserve_kernels.lora.serve import expand as ke

from flexserve_kernels.lora.serve import shrink as ks
I32 = "i32"
P = {"bf16": "*bf16", "fp32": "*fp32"}

def compile_one(fn, types, consts, num_warps, num_stages=3):
    sig = {name: "constexpr" if name in consts else types[name] for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts), target=target,
                            options={"num_warps": num_warps, "num_stages": num_stages})
    check_spills(kernel, f"{fn.__name__} {consts} warps={num_warps}")

def first_if(cond, configs):  # float32 (rare in serving): one configuration per kernel
    return configs[:1] if cond else configs

for dt, p in P.items():
    bk = 32 if dt == "fp32" else 64
    fp32 = dt == "fp32"
    for bm, br in first_if(fp32, ((64, 16), (16, 16), (64, 64), (16, 128))):
        types = dict(x_ptr=p, a_ptr=p, out_ptr="*fp32", seg_starts_ptr="*i32", seg_lens_ptr="*i32",
                     seg_slots_ptr="*i32", tile_map_ptr="*i32", hidden_size=I32, max_rank=I32,
                     k_per_split=I32, split_k=I32, num_map_tiles=I32,
                     stride_xm=I32, stride_as=I32, stride_ar=I32, stride_os=I32, stride_om=I32)
        for tile_map in (False, True) if bm == 64 else (False,):  # CUDA graphs' tiles are 64
            compile_one(ks._lora_shrink_sgmv_kernel, types,
                        dict(BLOCK_M=bm, BLOCK_R=br, BLOCK_K=bk, USE_TILE_MAP=tile_map),
                        8 if bm * br >= 4096 else 4)
    for br, bk in first_if(fp32, ((1, 4096), (16, 256), (64, 64))):
        types = dict(x_ptr=p, a_ptr=p, s_ptr="*fp32", token_slots_ptr="*i32", hidden_size=I32, max_rank=I32,
                     stride_xm=I32, stride_as=I32, stride_ar=I32, stride_sm=I32)
        compile_one(ks._lora_shrink_bgmv_kernel, types, dict(BLOCK_R=br, BLOCK_K=bk), 4)
    for bm, bn, br in first_if(fp32, ((64, 128, 64), (16, 32, 16), (64, 32, 16), (16, 128, 16), (64, 128, 16))):
        bn = min(bn, 64) if dt == "fp32" else bn
        types = dict(s_ptr="*fp32", b_ptr=p, y_ptr=p, scaling_ptr="*fp32", seg_starts_ptr="*i32",
                     seg_lens_ptr="*i32", seg_slots_ptr="*i32", tile_map_ptr="*i32", out_size=I32,
                     max_rank=I32, num_map_tiles=I32, stride_sm=I32,
                     stride_bs=I32, stride_bn=I32, stride_ym=I32)
        for tile_map in (False, True) if bm == 64 else (False,):
            compile_one(ke._lora_expand_sgmv_kernel, types,
                        dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br, USE_TILE_MAP=tile_map),
                        8 if bm * bn >= 4096 else 4, num_stages=2)
    for bn, br in first_if(fp32, ((256, 16), (32, 16), (32, 128))):
        types = dict(s_ptr="*fp32", b_ptr=p, y_ptr=p, scaling_ptr="*fp32", token_slots_ptr="*i32", out_size=I32,
                     max_rank=I32, stride_sm=I32, stride_bs=I32, stride_bn=I32, stride_ym=I32)
        compile_one(ke._lora_expand_bgmv_kernel, types, dict(BLOCK_N=bn, BLOCK_R=br), 4)
for br in (1, 16):
    types = dict(partial_ptr="*fp32", s_ptr="*fp32", token_slots_ptr="*i32", num_tokens=I32, max_rank=I32,
                 split_k=I32, stride_ps=I32, stride_pm=I32, stride_sm=I32)
    compile_one(ks._lora_shrink_reduce_kernel, types, dict(BLOCK_T=max(1, min(64, 4096 // br)), BLOCK_R=br), 4)
print("ok")
"""


def test_kernels_compile_for_hopper_without_spills():
    compile_for_hopper(_COMPILE_SCRIPT)


# ------------------------------------------------------------------ GPU: Llama-3.1-8B projections

# (in, out) of each distinct projection shape: q and o are 4096 -> 4096, k and v 4096 -> 1024.
LLAMA8B_SHAPES = {"q/o": (4096, 4096), "k/v": (4096, 1024), "gate/up": (4096, 14336), "down": (14336, 4096)}
# Rows of each batch: decode batches of one-token rows, and a 512-token mix of prefill chunks
# and decode rows.
LLAMA8B_BATCHES = {
    "decode-1": [1],
    "decode-16": [1] * 16,
    "decode-64": [1] * 64,
    "prefill-512": [200, 1, 1, 150, 37, 1, 100, 1, 21],
}


def _llama_slots(num_rows: int, num_adapters: int, seed: int) -> list[int]:
    # Rows spread over the adapters, about one in five without an adapter (never a lone row).
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, num_adapters, (num_rows,), generator=g)
    if num_rows > 1:
        slots[torch.rand(num_rows, generator=g) < 0.2] = -1
    return slots.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="Llama-sized shapes only compiled on a GPU")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("batch", sorted(LLAMA8B_BATCHES))
@pytest.mark.parametrize("num_adapters", [1, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_llama8b_shapes_match_float32_reference(dtype, num_adapters, batch, variant):
    row_lens = LLAMA8B_BATCHES[batch]
    row_slots = _llama_slots(len(row_lens), num_adapters, seed=len(row_lens) + num_adapters)
    meta = LoRAKernelMeta.build(row_lens, row_slots, "cuda")
    meta_cpu = LoRAKernelMeta.build(row_lens, row_slots, "cpu")
    g = torch.Generator().manual_seed(0)
    rank = 16
    for name, (in_size, out_size) in LLAMA8B_SHAPES.items():
        x = torch.randn(meta.num_tokens, in_size, generator=g).to(dtype)
        lora_a = (torch.randn(num_adapters, rank, in_size, generator=g) / math.sqrt(in_size)).to(dtype)
        lora_b = (torch.randn(num_adapters, out_size, rank, generator=g) / math.sqrt(rank)).to(dtype)
        y0 = torch.randn(meta.num_tokens, out_size, generator=g).to(dtype)
        scaling = torch.full((num_adapters,), 2.0)
        # float32 references on CPU: no TF32 whatever the CUDA matmul settings.
        s_ref = lora_shrink_ref(x, lora_a, meta_cpu)
        y_ref = lora_expand_ref(s_ref, lora_b, meta_cpu, y0.float(), scaling)

        y = y0.cuda()
        s = lora_ops.lora_shrink(x.cuda(), lora_a.cuda(), meta, variant=variant)
        lora_ops.lora_expand(s, lora_b.cuda(), meta, y, scaling.cuda(), variant=variant)
        assert rel_l2(s, s_ref) < SHRINK_TOL[dtype], name
        assert rel_l2(y, y_ref) < EXPAND_TOL[dtype], name
        base = base_rows(meta_cpu)
        assert torch.equal(y.cpu()[base], y0[base]), name

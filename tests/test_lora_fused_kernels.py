"""The fused decode LoRA kernel (lora_fused_bgmv: shrink + expand of 1-3 projections in one launch)
vs its torch reference, an independent unpadded oracle, and BGMV shrink + expand per projection.

Without CUDA the kernels run on CPU under Triton's interpreter, set up as in test_lora_kernels.py
(see its docstring): around the import, around each test, or in a child process when Triton was
imported first without it. With CUDA the same cases run compiled on the GPU (bf16 included), plus
Llama-3.1-8B-shaped and CUDA-graph tests. Either way the kernel is also compiled for sm_90 with the
wheel's ptxas (no GPU needed) to catch compile errors and register spills.

What the kernel writes (checked below): only the columns of each y_k, only the rows of tokens with
an adapter; base tokens' rows of x are never read (poisoned with NaN here).

Tolerances: the kernel and BGMV shrink + expand both keep s in float32 and round y once, so they
differ by fp32 summation order before that rounding: one ulp of y at most (2 eps relative below).
Against the float32 reference on the same 16-bit inputs only that final rounding differs; Triton's
interpreter converts fp32 to bf16 by truncating (numpy has no bf16), doubling the error there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from flexserve_kernels.lora.serve.meta import LoRAKernelMeta

from _triton_interpret import (
    compile_for_hopper,
    import_kernels,
    interpreter_hooks,
    is_interpreted,
    library_is_compiled,
)

_KERNEL_MODULES = ("flexserve_kernels.lora.serve.shrink", "flexserve_kernels.lora.serve.expand",
                   "flexserve_kernels.lora.serve.fused")


shrink_kernels, expand_kernels, fused_kernels = import_kernels(_KERNEL_MODULES, interpret=not torch.cuda.is_available())
lora_fused_bgmv = fused_kernels.lora_fused_bgmv
lora_fused_bgmv_ref = fused_kernels.lora_fused_bgmv_ref

INTERPRETED = is_interpreted(fused_kernels._lora_fused_bgmv_kernel)
# Interpreted kernels run on CPU tensors; compiled ones on the GPU (the lead's CI for this file).
DEVICE = "cpu" if INTERPRETED else "cuda"
# Another module imported Triton first, outside the interpreter: its library cannot run
# interpreted in this process, so the whole module runs in a child process instead.
RUN_IN_CHILD = INTERPRETED and library_is_compiled()

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


test_module_in_interpreter_child_process, _triton_interpret = interpreter_hooks(
    __file__, INTERPRETED, RUN_IN_CHILD)


@dataclass(frozen=True)
class Case:
    in_size: int  # x's last dimension
    out_sizes: tuple[int, ...]  # each projection's output size
    max_ranks: tuple[int, ...]  # each projection's slot width
    slot_ranks: tuple[int, ...]  # true rank of each slot's adapter (capped at a projection's max_rank)
    token_slots: tuple[int, ...]  # slot of each token, -1 = base model

    @property
    def num_tokens(self) -> int:
        return len(self.token_slots)


CASES = {
    # q/k/v-like: one input, three outputs; ranks 16, 8 and 1 zero-padded to 16.
    "qkv-in100-o96.32.32-r16": Case(100, (96, 32, 32), (16, 16, 16), (16, 8, 1), (0, -1, 1, 2, 0, -1, 1)),
    # gate/up-like: two odd outputs, ranks 64, 7 and 33 padded to 64.
    "gateup-in130-o100.100-r64": Case(130, (100, 100), (64, 64), (64, 7, 33), (2, 0, -1, 1, 1)),
    # One projection of rank 1 (a one-lane shrink), sizes prime to every block.
    "single-in33-o45-r1": Case(33, (45,), (1,), (1, 1), (1, -1, 0, 0)),
    # Projections of different slot widths (8, 16, 4) in one launch; outputs below one tile.
    "mixed-in77-o20.130.17": Case(77, (20, 130, 17), (8, 16, 4), (8, 3, 16), (1, 2, -1, 0, 2, 1)),
}
# Block overrides: the launcher's choice, and tiny blocks so every loop steps through masked tails
# (in 100 in 16s, several 16-output steps per 32-output tile, partial last tiles).
BLOCKS = {"auto": {}, "small": dict(block_k=16, block_n=16, tile_n=32)}


def make_inputs(case: Case, dtype: torch.dtype = torch.float32, device: str = DEVICE, seed: int = 0):
    """x, [(lora_a, lora_b, scaling)], token_slots, y0s; unit-scale deltas so errors read as relative."""
    g = torch.Generator().manual_seed(seed)
    num_slots = len(case.slot_ranks)
    weights = []
    for out_size, max_rank in zip(case.out_sizes, case.max_ranks):
        lora_a = torch.zeros(num_slots, max_rank, case.in_size)
        lora_b = torch.zeros(num_slots, out_size, max_rank)
        for slot, rank in enumerate(case.slot_ranks):
            rank = min(rank, max_rank)
            lora_a[slot, :rank] = torch.randn(rank, case.in_size, generator=g) / math.sqrt(case.in_size)
            lora_b[slot, :, :rank] = torch.randn(out_size, rank, generator=g) / math.sqrt(rank)
        scaling = torch.rand(num_slots, generator=g) + 0.5
        weights.append((lora_a.to(device, dtype), lora_b.to(device, dtype), scaling.to(device)))
    x = torch.randn(case.num_tokens, case.in_size, generator=g).to(device, dtype)
    y0s = [torch.randn(case.num_tokens, n, generator=g).to(device, dtype) for n in case.out_sizes]
    token_slots = torch.tensor(case.token_slots, dtype=torch.int32, device=device)
    return x, weights, token_slots, y0s


def wide_outputs(y0s: list[torch.Tensor], pad: int = 3, fill: float = -777.0):
    """The y's as column slices of one wider output (as from a fused qkv GEMM), with `pad`
    poisoned columns before, between and after them: (wide, ys, mask of the y columns)."""
    num_tokens = y0s[0].shape[0]
    width = sum(y.shape[1] for y in y0s) + pad * (len(y0s) + 1)
    wide = torch.full((num_tokens, width), fill, dtype=y0s[0].dtype, device=y0s[0].device)
    inside = torch.zeros(width, dtype=torch.bool, device=wide.device)
    ys, start = [], pad
    for y0 in y0s:
        y = wide[:, start : start + y0.shape[1]]
        y.copy_(y0)
        inside[start : start + y0.shape[1]] = True
        ys.append(y)
        start += y0.shape[1] + pad
    return wide, ys, inside


def projections(weights, ys):
    return [(a, b, s, y) for (a, b, s), y in zip(weights, ys)]


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double().cpu()
    return ((actual.double().cpu() - expected).norm() / expected.norm()).item()


def one_ulp(dtype: torch.dtype) -> dict:
    """assert_close tolerances for results that may differ by one rounding of y."""
    return dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-6) if dtype != torch.float32 else dict(rtol=1e-5, atol=2e-6)


# Relative L2 error vs the float32 reference on the same 16-bit inputs: y's final rounding (half an
# ulp, a whole one where the interpreter truncates bf16), about 3e-4 in fp16 and 3e-3 in bf16 here.
REF_TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}


# ------------------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("blocks", sorted(BLOCKS))
@pytest.mark.parametrize("case_id", sorted(CASES))
def test_matches_reference_and_touches_only_adapter_rows(case_id, blocks):
    case = CASES[case_id]
    x, weights, token_slots, y0s = make_inputs(case)
    expected = [y0.clone() for y0 in y0s]
    lora_fused_bgmv_ref(x, projections(weights, expected), token_slots)
    base = token_slots < 0
    wide, ys, inside = wide_outputs(y0s)
    before = wide.clone()
    x[base] = float("nan")  # never read: a base token's row would turn its outputs NaN

    lora_fused_bgmv(x, projections(weights, ys), token_slots, **BLOCKS[blocks])
    for k, (y, want) in enumerate(zip(ys, expected)):
        torch.testing.assert_close(y, want, atol=2e-6, rtol=1e-5, msg=lambda m: f"projection {k}: {m}")
    assert torch.equal(wide[base], before[base])
    assert torch.equal(wide[:, ~inside], before[:, ~inside])


@pytest.mark.parametrize("case_id", ["qkv-in100-o96.32.32-r16", "gateup-in130-o100.100-r64"])
def test_zero_padded_ranks_match_unpadded_adapters(case_id):
    # Each slot's adapter at its true rank, computed here without lora_ref: padding adds nothing.
    case = CASES[case_id]
    x, weights, token_slots, y0s = make_inputs(case)
    ys = [y0.clone() for y0 in y0s]
    lora_fused_bgmv(x, projections(weights, ys), token_slots)
    for (lora_a, lora_b, scaling), y, y0, max_rank in zip(weights, ys, y0s, case.max_ranks):
        expected = y0.clone()
        for token, slot in enumerate(case.token_slots):
            if slot >= 0:
                rank = min(case.slot_ranks[slot], max_rank)
                expected[token] += scaling[slot] * (lora_b[slot, :, :rank] @ (lora_a[slot, :rank] @ x[token]))
        torch.testing.assert_close(y, expected, atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case_id", sorted(CASES))
def test_equals_bgmv_shrink_then_expand_per_projection(case_id, dtype):
    case = CASES[case_id]
    x, weights, token_slots, y0s = make_inputs(case, dtype=dtype)
    meta = LoRAKernelMeta.build([1] * case.num_tokens, list(case.token_slots), DEVICE)
    ys = [y0.clone() for y0 in y0s]
    lora_fused_bgmv(x, projections(weights, ys), token_slots)
    for k, ((lora_a, lora_b, scaling), y, y0) in enumerate(zip(weights, ys, y0s)):
        pair = y0.clone()
        s = shrink_kernels.lora_shrink_bgmv(x, lora_a, meta)
        expand_kernels.lora_expand_bgmv(s, lora_b, meta, pair, scaling)
        torch.testing.assert_close(y, pair, **one_ulp(dtype), msg=lambda m: f"projection {k}: {m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_matches_float32_reference(dtype):
    case = CASES["qkv-in100-o96.32.32-r16"]
    x, weights, token_slots, y0s = make_inputs(case, dtype=dtype)
    ys = [y0.clone() for y0 in y0s]
    lora_fused_bgmv(x, projections(weights, ys), token_slots)
    want = [y0.float() for y0 in y0s]
    lora_fused_bgmv_ref(x.float(), [(a.float(), b.float(), s, y) for (a, b, s), y in zip(weights, want)],
                        token_slots)
    base = token_slots < 0
    for y, y0, w in zip(ys, y0s, want):
        assert rel_l2(y, w) < REF_TOL[dtype]
        assert torch.equal(y[base], y0[base])


def test_no_tokens_no_outputs_and_no_adapters_leave_y_alone():
    x, weights, token_slots, y0s = make_inputs(CASES["qkv-in100-o96.32.32-r16"])
    empty_ys = [y0[:0] for y0 in y0s]
    lora_fused_bgmv(x[:0], projections(weights, empty_ys), token_slots[:0])  # T = 0: no launch
    lora_fused_bgmv_ref(x[:0], projections(weights, empty_ys), token_slots[:0])
    (a, b, s), y = weights[0], y0s[0].clone()
    lora_fused_bgmv(x, [(a, b[:, :0], s, y[:, :0])], token_slots)  # no output column: no launch
    ys = [y0.clone() for y0 in y0s]
    lora_fused_bgmv(x, projections(weights, ys), torch.full_like(token_slots, -1))
    assert all(torch.equal(y, y0) for y, y0 in zip(ys, y0s))


def test_int64_token_slots_and_tile_choice():
    case = CASES["gateup-in130-o100.100-r64"]
    x, weights, token_slots, y0s = make_inputs(case)
    expected = [y0.clone() for y0 in y0s]
    lora_fused_bgmv_ref(x, projections(weights, expected), token_slots)
    ys = [y0.clone() for y0 in y0s]
    lora_fused_bgmv(x, projections(weights, ys), token_slots.long(), block_n=32, tile_n=128)
    for y, want in zip(ys, expected):
        torch.testing.assert_close(y, want, atol=2e-6, rtol=1e-5)
    # The tile model on Llama-3.1-8B's qkv (132 SMs): fewer, longer tiles as the batch grows.
    pick = fused_kernels.pick_tile_n
    assert [pick(t, 4096, (4096, 1024, 1024), 16, 2, 512, 132) for t in (1, 16, 64)] == [512, 1024, 2048]
    assert pick(1, 33, (45,), 1, 4, 64, 8) == 64


# ------------------------------------------------------------------------------------- bad inputs


def _bad_inputs():
    x, weights, token_slots, y0s = make_inputs(CASES["qkv-in100-o96.32.32-r16"])
    (a, b, s), (a1, b1, s1) = weights[0], weights[1]
    y, y1 = y0s[0], y0s[1]

    def first(**kw):  # the first projection with some of its tensors replaced
        return dict(projections=[(kw.get("a", a), kw.get("b", b), kw.get("s", s), kw.get("y", y))])

    return {
        "no projection": (dict(projections=[]), "1 to 3 projections"),
        "four projections": (dict(projections=[(a, b, s, y)] * 4), "1 to 3 projections"),
        "three items": (dict(projections=[(a, b, s)]), "\\(lora_a, lora_b, scaling, y\\)"),
        "1-d x": (dict(x=x[0]), "x \\[T, in\\]"),
        "int x": (dict(x=x.to(torch.int32)), "x must be one of"),
        "hidden size": (dict(x=x[:, :99]), "hidden size 99"),
        "rank-2 lora_a": (first(a=a[0]), "lora_a \\[num_slots, max_rank, in\\]"),
        "rank mismatch": (first(b=b[:, :, :8]), "max_rank 16"),
        "slot mismatch": (dict(projections=[(a, b, s, y), (a1[:2], b1[:2], s1[:2], y1)]), "must have 3"),
        "scaling size": (first(s=s[:2]), "2 slots; every projection must have 3"),
        "scaling dtype": (first(s=s.double()), "scaling must be float32"),
        "y dtype": (first(y=y.double()), "x's dtype"),
        "lora dtype": (first(b=b.half()), "x's dtype"),
        "y tokens": (first(y=y[:-1]), "must be \\[T, out\\]"),
        "y out size": (first(y=y[:, :95]), "must be \\[T, out\\]"),
        "strided y": (first(y=torch.randn(96, y.shape[0], device=DEVICE).T), "contiguous in its last"),
        "strided lora_a": (first(a=a.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous in its last"),
        "strided x": (dict(x=torch.randn(100, x.shape[0], device=DEVICE).T), "contiguous in its last"),
        "token count": (dict(token_slots=token_slots[:-1]), "token_slots must be \\[T\\]"),
        "float slots": (dict(token_slots=token_slots.float()), "int32 or int64"),
        "block_n": (dict(block_n=48), "block_n must be a power of two"),
        "tile_n": (dict(block_n=64, tile_n=32), "tile_n 32 must be at least block_n 64"),
    }, dict(x=x, projections=[(a, b, s, y)], token_slots=token_slots)


@pytest.mark.parametrize("which", sorted(_bad_inputs()[0]))
def test_rejects_bad_inputs(which):
    bad, args = _bad_inputs()
    override, message = bad[which]
    with pytest.raises(ValueError, match=message):
        lora_fused_bgmv(**{**args, **override})
    if not {"block_n", "tile_n"} & set(override):
        with pytest.raises(ValueError, match=message):
            lora_fused_bgmv_ref(**{**args, **override})


# ------------------------------------------------------------------- compiled for Hopper, no GPU

# Compiles the kernel (not interpreted: a fresh process without TRITON_INTERPRET) for sm_90 with the
# ptxas that ships in the triton wheel, with the launcher's 16-divisibility specialization of
# pointers and sizes (Llama's are all multiples of 16), for the tiles it picks on Llama-3.1-8B
# shapes; fails on a compile error, on register spills, or when the loops lose their pipelining
# (tl.range num_stages: async copies in the TTGIR). The interpreter cannot catch any of these.
_COMPILE_SCRIPT = r"""
import triton
from triton.compiler import ASTSource
from flexserve_kernels.lora.serve import fused as kf

fn = kf._lora_fused_bgmv_kernel

def projection_types(k, p):
    sizes = (f"out{k}", f"rank{k}", f"stride_a{k}s", f"stride_a{k}r", f"stride_b{k}s", f"stride_b{k}n", f"stride_y{k}m")
    return {f"a{k}_ptr": p, f"b{k}_ptr": p, f"scaling{k}_ptr": "*fp32", f"y{k}_ptr": p, **dict.fromkeys(sizes, "i32")}

def compile_one(dt, num_proj, rank_pad, block_k, block_n, tile_n):
    p = "*" + dt
    types = dict(x_ptr=p, token_slots_ptr="*i32", in_size="i32", stride_xm="i32")
    consts = dict(NUM_PROJ=num_proj, RANK_PAD=rank_pad, BLOCK_K=block_k, BLOCK_N=block_n, TILE_N=tile_n,
                  NUM_STAGES=3)
    for k in range(3):
        if k < num_proj:
            types.update(projection_types(k, p))
        else:  # as the launcher passes them: None pointers, zero sizes
            consts.update({n: None if n.endswith("_ptr") else 0 for n in projection_types(k, p)})
    sig = {name: "constexpr" if name in consts else types[name] for name in fn.arg_names}
    # The launcher's specialization of 16-aligned pointers and multiples of 16 (Llama's sizes).
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in types}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=target,
                            options={"num_warps": 8, "num_stages": 3})
    label = f"{dt} proj={num_proj} rank={rank_pad} bk={block_k} bn={block_n} tile={tile_n}"
    if "async_copy_global_to_local" not in kernel.asm["ttgir"]:
        sys.exit(f"{label}: the loops are not pipelined")
    check_spills(kernel, label)

# rank 16: qkv at batch 1, gate/up at 64, one projection; rank 64 and 128 (max_lora_rank's range).
compile_one("bf16", 3, 16, 512, 512, 512)
compile_one("bf16", 2, 16, 512, 512, 16384)
compile_one("bf16", 1, 16, 512, 512, 2048)
compile_one("bf16", 3, 64, 128, 128, 1024)
compile_one("fp16", 2, 128, 64, 64, 64)
compile_one("fp32", 3, 16, 512, 512, 512)
print("ok")
"""


def test_kernel_compiles_for_hopper_without_spills():
    compile_for_hopper(_COMPILE_SCRIPT)


# -------------------------------------------------------------- GPU: Llama-3.1-8B, CUDA graphs

# Per decoder layer: (in, outs) of each fused launch (q/k/v, o, gate/up, down).
LLAMA8B_LAUNCHES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
                    "down": (14336, (4096,))}


def _llama_inputs(in_size, out_sizes, num_tokens, num_slots, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rank = 16
    slots = torch.randint(0, num_slots, (num_tokens,), generator=g)
    if num_tokens > 1:
        slots[torch.rand(num_tokens, generator=g) < 0.2] = -1
    x = torch.randn(num_tokens, in_size, generator=g).to(dtype)
    weights = [((torch.randn(num_slots, rank, in_size, generator=g) / math.sqrt(in_size)).to(dtype),
                (torch.randn(num_slots, n, rank, generator=g) / math.sqrt(rank)).to(dtype),
                torch.rand(num_slots, generator=g) + 0.5) for n in out_sizes]
    return x, weights, slots.to(torch.int32)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="Llama-sized shapes only compiled on a GPU")
@pytest.mark.parametrize("num_tokens", [1, 16, 64])
@pytest.mark.parametrize("launch", sorted(LLAMA8B_LAUNCHES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_llama8b_shapes_match_reference_and_bgmv(dtype, launch, num_tokens):
    in_size, out_sizes = LLAMA8B_LAUNCHES[launch]
    x, weights, slots = _llama_inputs(in_size, out_sizes, num_tokens, 4, dtype, seed=num_tokens)
    y0s = [torch.randn(num_tokens, n).to(dtype) for n in out_sizes]
    # float32 reference on CPU: no TF32 whatever the CUDA matmul settings.
    want = [y0.float() for y0 in y0s]
    lora_fused_bgmv_ref(x.float(), [(a.float(), b.float(), s, w) for (a, b, s), w in zip(weights, want)], slots)
    cuda = lambda t: t.cuda()  # noqa: E731
    wide, ys, _ = wide_outputs([cuda(y0) for y0 in y0s])
    weights_gpu = [(cuda(a), cuda(b), cuda(s)) for a, b, s in weights]
    lora_fused_bgmv(cuda(x), projections(weights_gpu, ys), cuda(slots))
    meta = LoRAKernelMeta.build([1] * num_tokens, slots.tolist(), "cuda")
    base = slots < 0
    for (a, b, s), y, y0, w in zip(weights_gpu, ys, y0s, want):
        assert rel_l2(y, w) < REF_TOL[dtype], launch
        assert torch.equal(y.cpu()[base], y0[base]), launch
        pair = cuda(y0)
        expand_kernels.lora_expand_bgmv(shrink_kernels.lora_shrink_bgmv(cuda(x), a, meta), b, meta, pair, s)
        torch.testing.assert_close(y, pair, **one_ulp(dtype))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_follows_new_slots_and_inputs():
    # Captured once with every token on the base model (as CUDAGraphRunner captures), replayed with
    # adapters and new activations copied into the static buffers.
    in_size, out_sizes = LLAMA8B_LAUNCHES["qkv"]
    num_tokens = 16
    x, weights, slots = _llama_inputs(in_size, out_sizes, num_tokens, 4, torch.bfloat16, seed=1)
    weights = [(a.cuda(), b.cuda(), s.cuda()) for a, b, s in weights]
    static_x = torch.zeros_like(x, device="cuda")
    static_slots = torch.full((num_tokens,), -1, dtype=torch.int32, device="cuda")
    wide, ys, _ = wide_outputs([torch.zeros(num_tokens, n, dtype=torch.bfloat16, device="cuda") for n in out_sizes])
    lora_fused_bgmv(static_x, projections(weights, ys), static_slots)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_fused_bgmv(static_x, projections(weights, ys), static_slots)
    y0s = [torch.randn(num_tokens, n, dtype=torch.bfloat16, device="cuda") for n in out_sizes]
    for y, y0 in zip(ys, y0s):
        y.copy_(y0)
    static_x.copy_(x)
    static_slots.copy_(slots)
    graph.replay()
    expected = [y0.clone() for y0 in y0s]
    lora_fused_bgmv(x.cuda(), projections(weights, expected), slots.cuda())
    for y, want in zip(ys, expected):
        assert torch.equal(y, want)

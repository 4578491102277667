"""Folded decode LoRA: the slots' A rows ride in the merged GEMM (`MergedProjection.fold_lora`) and
`lora_expand_folded` adds s B^T; against its torch reference, an unfolded fp32 oracle and the
unfolded model path.

Without CUDA the kernel runs on CPU under Triton's interpreter (set up as in
test_lora_kernels.py's docstring); with CUDA the same cases run compiled, plus Llama-3.1-8B
shapes in bf16. The kernel is also compiled for sm_90 offline (compile errors, spills).

Tolerances: the kernel and the reference both form the delta in fp32 from the same s and round y
once, so they differ by fp32 summation order: in 16-bit one ulp of y (2 eps relative below; the
interpreter truncates fp32 -> bf16, doubling it), in fp32 a few ulps (1e-5 relative). The fused
SiLU-and-mul against the expand-then-activation reference: fp32 1e-5; bf16 2e-2 (a rounded
intermediate one ulp apart moves the op's rounded result by up to two ulps). Against the unfolded
fp32 oracle, 16-bit runs also round s to the model dtype in the GEMM: relative L2 <= 1e-2 for bf16.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _triton_interpret import (
    compile_for_hopper,
    import_kernels,
    interpreter_hooks,
    is_interpreted,
    library_is_compiled,
)

folded_kernels, act_kernels = import_kernels(
    ("flexserve_kernels.lora.serve.expand_folded", "flexserve_kernels.activation"),
    interpret=not torch.cuda.is_available())
lora_expand_folded = folded_kernels.lora_expand_folded
lora_expand_folded_ref = folded_kernels.lora_expand_folded_ref

INTERPRETED = is_interpreted(folded_kernels._lora_expand_folded_kernel)
DEVICE = "cpu" if INTERPRETED else "cuda"
RUN_IN_CHILD = INTERPRETED and library_is_compiled()


test_module_in_interpreter_child_process, _triton_interpret = interpreter_hooks(
    __file__, INTERPRETED, RUN_IN_CHILD)


def _case(sizes, num_slots, max_rank, token_slots, dtype, seed=0, in_size=24):
    """x, per-projection (A [S, R, in], B [S, n, R], scaling [S]) with slot ranks below max_rank
    zero-padded, and the folded GEMM's output (y0 | s) for those x."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = len(token_slots)
    x = torch.randn(num_tokens, in_size, generator=g)
    weights = []
    for n in sizes:
        a = torch.randn(num_slots, max_rank, in_size, generator=g) / in_size**0.5
        b = torch.randn(num_slots, n, max_rank, generator=g) / max_rank**0.5
        for slot in range(num_slots):  # true rank of slot k: max_rank - k (at least 1)
            rank = max(1, max_rank - slot)
            a[slot, rank:] = 0
            b[slot, :, rank:] = 0
        weights.append((a, b, torch.rand(num_slots, generator=g) + 0.5))
    w = torch.randn(sum(sizes), in_size, generator=g) / in_size**0.5
    a_rows = torch.cat([a.reshape(num_slots * max_rank, in_size) for a, _, _ in weights])
    out = (x @ torch.cat([w, a_rows]).T).to(dtype)
    lora_b = torch.cat([b for _, b, _ in weights], dim=1).to(dtype)
    scaling = torch.stack([s for _, _, s in weights])
    slots = torch.tensor(token_slots, dtype=torch.int32)
    return x, w, weights, out, lora_b, scaling, slots


def _oracle(x, w, weights, token_slots):
    """y = x W^T + per projection scaling * (x A[slot]^T) B[slot]^T, unfolded, fp32."""
    y = x @ w.T
    start = 0
    for a, b, s in weights:
        cols = slice(start, start + b.shape[1])
        for t, slot in enumerate(token_slots):
            if slot >= 0:
                y[t, cols] += s[slot] * (x[t] @ a[slot].T) @ b[slot].T
        start += b.shape[1]
    return y


CASES = {
    # sizes, num_slots, max_rank, token_slots
    "qkv-odd": ((40, 24, 24), 3, 5, (0, -1, 2, 1, 2, -1, 0)),
    "pair": ((33, 33), 2, 16, (1, 0, 1)),
    "single-rank1": ((17,), 4, 1, (3, -1, 0)),
    "single-r64": ((100,), 2, 64, (1, 1, -1, 0, 1)),
    "all-base": ((16, 8), 2, 4, (-1, -1)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case_id", sorted(CASES))
def test_matches_reference_oracle_and_leaves_base_rows(case_id, dtype):
    sizes, num_slots, max_rank, token_slots = CASES[case_id]
    x, w, weights, out, lora_b, scaling, slots = _case(sizes, num_slots, max_rank, token_slots, dtype)
    base = sum(sizes)
    out[slots < 0, base:] = float("nan")  # never read for tokens without an adapter
    want = out.clone()
    lora_expand_folded_ref(want[:, base:], lora_b, scaling, want[:, :base], slots, sizes)
    got = out.to(DEVICE)
    lora_expand_folded(got[:, base:], lora_b.to(DEVICE), scaling.to(DEVICE), got[:, :base], slots.to(DEVICE), sizes,
                       block_n=16)
    got = got.cpu()
    if dtype == torch.float32:  # summation order over up to 64 rank terms
        torch.testing.assert_close(got[:, :base], want[:, :base], rtol=1e-5, atol=1e-6)
    else:
        eps = torch.finfo(dtype).eps * (4 if INTERPRETED else 2)
        torch.testing.assert_close(got[:, :base], want[:, :base], rtol=eps, atol=eps)
    rows = slots < 0
    assert torch.equal(got[rows, :base], out[rows, :base])  # base rows untouched
    oracle = _oracle(x, w, weights, token_slots)
    err = (got[:, :base].float() - oracle).norm() / oracle.norm()
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), err


def test_default_tile_and_int64_slots():
    sizes, num_slots, max_rank, token_slots = CASES["qkv-odd"]
    x, w, weights, out, lora_b, scaling, slots = _case(sizes, num_slots, max_rank, token_slots, torch.float32)
    got = out.to(DEVICE)
    lora_expand_folded(got[:, 88:], lora_b.to(DEVICE), scaling.to(DEVICE), got[:, :88], slots.long().to(DEVICE), sizes)
    torch.testing.assert_close(got[:, :88].cpu(), _oracle(x, w, weights, token_slots), rtol=1e-5, atol=1e-5)


def test_rejects_bad_inputs():
    sizes, num_slots, max_rank, token_slots = CASES["pair"]
    _, _, _, out, lora_b, scaling, slots = _case(sizes, num_slots, max_rank, token_slots, torch.float32)
    s, y = out[:, 66:], out[:, :66]
    cases = [
        (dict(sizes=(33, 30)), "must agree"),
        (dict(sizes=()), "1 to 3"),
        (dict(scaling=scaling[:1]), "scaling must be"),
        (dict(scaling=scaling.double()), "float32"),
        (dict(s=s[:, :10]), "s must be"),
        (dict(token_slots=slots[:2]), "token_slots must be"),
        (dict(token_slots=slots.float()), "int32 or int64"),
        (dict(lora_b=lora_b.half()), "one dtype"),
        (dict(y=y.T.contiguous().T), "contiguous"),
        (dict(lora_b=lora_b[:, :, :0]), "no slot or no rank"),
    ]
    for override, message in cases:
        args = {**dict(s=s, lora_b=lora_b, scaling=scaling, y=y, token_slots=slots, sizes=sizes), **override}
        with pytest.raises(ValueError, match=message):
            lora_expand_folded_ref(**args)


# ---------------------------------------------------------------- the folded MergedProjection


def _group(out_sizes, in_size=24, num_slots=3, max_rank=4, bias=False, seed=0):
    from flexserve.layers.lora_linear import LoRALinear

    torch.manual_seed(seed)
    return tuple(LoRALinear(nn.Linear(in_size, n, bias=bias), num_slots, max_rank, 0, target)
                 for n, target in zip(out_sizes, ("q_proj", "k_proj", "v_proj")))


def _expected(linears, x, token_slots, adapters):
    outs = []
    for k, m in enumerate(linears):
        y = x @ m.weight.T + (0 if m.bias is None else m.bias)
        for t, slot in enumerate(token_slots):
            if slot >= 0 and (slot, k) in adapters:
                a, b, scaling = adapters[(slot, k)]
                y[t] += scaling * (x[t] @ a.T) @ b.T
        outs.append(y)
    return outs


@pytest.mark.parametrize("bias", [False, True])
def test_folded_group_equals_unfolded_math_and_follows_slot_loads(bias):
    from flexserve.layers.forward_context import set_forward_context
    from flexserve.model.llama import MergedProjection
    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta

    linears = _group((12, 8, 8), bias=bias)
    group = MergedProjection()
    group.merge(linears)
    assert group.fold_lora(linears, max_fraction=10.0)
    assert group.folded.shape == (28 + 3 * 3 * 4, 24)
    # The projections' Parameters and LoRA buffers are views of the group's tensors.
    assert linears[1].weight.data_ptr() == group.folded[12:].data_ptr()
    assert linears[2].lora_a.data_ptr() == group.folded[28 + 2 * 12:].data_ptr()
    g = torch.Generator().manual_seed(3)
    adapters = {}
    for slot, rank, targets in ((0, 4, (0, 1, 2)), (2, 2, (0, 2))):  # slot 2 leaves k_proj alone
        for k, m in enumerate(linears):
            if k in targets:
                a, b = torch.randn(rank, 24, generator=g), torch.randn(m.out_features, rank, generator=g)
                adapters[(slot, k)] = (a, b, 0.5 + slot)
                m.set_slot(slot, a, b, 0.5 + slot)
            else:
                m.set_slot(slot, None, None)
    x = torch.randn(5, 24, generator=g)
    token_slots = [0, -1, 2, 2, 0]
    want = _expected(linears, x, token_slots, adapters)
    meta = LoRAKernelMeta.build([1] * 5, token_slots, "cpu")
    # Decode-sized: the folded GEMM and the expand kernel; 80 tokens of one prefill: unfolded.
    with set_forward_context(None, meta):
        got = group(x, linears)
    for y, w in zip(got, want):
        torch.testing.assert_close(y, w, rtol=1e-5, atol=1e-5)
    x_long = torch.randn(80, 24, generator=g)
    meta_long = LoRAKernelMeta.build([80], [2], "cpu")
    with set_forward_context(None, meta_long):
        got = group(x_long, linears)
    for y, w in zip(got, _expected(linears, x_long, [2] * 80, adapters)):
        torch.testing.assert_close(y, w, rtol=1e-5, atol=1e-5)


def test_fold_refused_over_max_fraction_keeps_unmerged_single_linears():
    from flexserve.model.llama import MergedProjection

    (o,) = _group((8,), num_slots=4, max_rank=4)
    group = MergedProjection()
    assert not group.fold_lora((o,), max_fraction=1.0)  # 16 A rows over 8 weight rows
    assert group.weight is None and group.folded is None
    assert group.fold_lora((o,), max_fraction=2.0)
    assert group.weight.shape == (8, 24) and o.weight.data_ptr() == group.folded.data_ptr()


def test_model_folds_every_group_and_decodes_like_the_unfolded_model():
    from transformers import LlamaConfig

    from flexserve.layers.forward_context import set_forward_context
    from flexserve.model.llama import LlamaForCausalLM
    from flexserve.worker.lora_manager import attach_lora_linears
    from flexserve_kernels.lora.serve.meta import LoRAKernelMeta

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    attach_lora_linears(model, 2, 4)
    assert model.fold_lora_shrinks() == 0  # not merged: the CPU path folds nothing
    model.merge_projections()
    assert model.fold_lora_shrinks(max_fraction=1.0) == 8  # 4 groups x 2 layers
    g = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for m in parent.children():
                if hasattr(m, "set_slot"):
                    m.set_slot(1, torch.randn(3, m.in_features, generator=g) * 0.3,
                               torch.randn(m.out_features, 3, generator=g) * 0.3, 2.0)
    x = torch.randn(3, 32, generator=g)
    meta = LoRAKernelMeta.build([1, 1, 1], [1, -1, 1], "cpu")
    layer = model.model.layers[0]
    with set_forward_context(None, meta):
        mlp_folded = layer.mlp(x)  # gate/up expanded inside SiLU-and-mul, down by its own launch
    unfolded = []
    for t, slot in enumerate([1, -1, 1]):  # each row alone through the LoRALinear forwards
        row_meta = LoRAKernelMeta.build([1], [slot], "cpu")
        gate, up = layer.mlp.gate_proj, layer.mlp.up_proj
        with set_forward_context(None, row_meta):
            h = torch.nn.functional.silu(gate(x[t:t + 1])) * up(x[t:t + 1])
            unfolded.append(layer.mlp.down_proj(h))
    torch.testing.assert_close(mlp_folded, torch.cat(unfolded), rtol=1e-5, atol=1e-5)


# ------------------------------------------------ the expand fused into SiLU-and-mul and RMSNorm


def _bypass(sizes, num_rows, dtype, seed, token_slots, num_slots=3, max_rank=5):
    from flexserve_kernels.lora.serve.folded import FoldedLoRA

    g = torch.Generator().manual_seed(seed)
    width = sum(sizes)
    s = torch.randn(num_rows, len(sizes) * num_slots * max_rank, generator=g).to(dtype)
    lora_b = (torch.randn(num_slots, width, max_rank, generator=g) / 2).to(dtype)
    scaling = torch.rand(len(sizes), num_slots, generator=g) + 0.5
    slots = torch.tensor(token_slots, dtype=torch.int32)
    return FoldedLoRA(s, lora_b, scaling, slots, tuple(sizes))


def _on(bypass, device):
    from flexserve_kernels.lora.serve.folded import FoldedLoRA

    return FoldedLoRA(bypass.s.to(device), bypass.lora_b.to(device), bypass.scaling.to(device),
                      bypass.token_slots.to(device), bypass.sizes)


def _expanded(bypass, y):
    y = y.clone()
    lora_expand_folded_ref(bypass.s, bypass.lora_b, bypass.scaling, y, bypass.token_slots, bypass.sizes)
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [40, 300])
def test_silu_and_mul_with_folded_lora_equals_expand_then_activation(width, dtype):
    token_slots = [1, -1, 0, 2]
    bypass = _bypass((width, width), 4, dtype, seed=width, token_slots=token_slots)
    gate_up = torch.randn(4, 2 * width + 7).to(dtype)[:, :2 * width]  # a strided GEMM output slice
    want = act_kernels.silu_and_mul_ref(_expanded(bypass, gate_up))
    got_in = gate_up.to(DEVICE)
    got = act_kernels.silu_and_mul(got_in[:, :width], got_in[:, width:], lora=_on(bypass, DEVICE)).cpu()
    assert torch.equal(got_in.cpu(), gate_up)  # gate and up themselves are not written
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    with pytest.raises(ValueError, match="gate/up pair"):
        act_kernels.silu_and_mul(got_in[:, :width - 1], got_in[:, width:2 * width - 1], lora=_on(bypass, DEVICE))


# -------------------------------------------------------------- compiled for Hopper, no GPU

_COMPILE_SCRIPT = r"""
import triton
from triton.compiler import ASTSource
from flexserve_kernels.lora.serve import expand_folded as kf

fn = kf._lora_expand_folded_kernel

def compile_one(dt, rank_pad, block_n, num_proj):
    p = "*" + dt
    types = dict(s_ptr=p, b_ptr=p, scaling_ptr="*fp32", y_ptr=p, token_slots_ptr="*i32",
                 out_size="i32", end0="i32", end1="i32", num_slots="i32", max_rank="i32",
                 stride_sm="i32", stride_bs="i32", stride_bn="i32", stride_ym="i32")
    consts = dict(NUM_PROJ=num_proj, RANK_PAD=rank_pad, BLOCK_N=block_n)
    sig = {name: "constexpr" if name in consts else types[name] for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts), target=target, options={"num_warps": 4})
    check_spills(kernel, f"{dt} rank={rank_pad} bn={block_n} proj={num_proj}")

LORA_TYPES = dict(s_ptr=None, b_ptr=None, scaling_ptr="*fp32", token_slots_ptr="*i32", end0="i32", end1="i32",
                  num_slots="i32", max_rank="i32", stride_sm="i32", stride_bs="i32", stride_bn="i32")

def compile_fused(fn, dt, types, consts, num_warps):
    p = "*" + dt
    types = {**{k: (p if v is None else v) for k, v in LORA_TYPES.items()}, **types}
    sig = {name: "constexpr" if name in consts else types[name] for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts), target=target, options={"num_warps": num_warps})
    check_spills(kernel, f"{fn.__name__} {dt} {consts}")

from flexserve_kernels import activation
for dt in ("bf16", "fp32"):
    p = "*" + dt
    compile_fused(activation._silu_and_mul_kernel, dt,
                  dict(gate_ptr=p, up_ptr=p, out_ptr=p, width="i32", stride_g="i32", stride_u="i32", stride_o="i32"),
                  dict(HAS_LORA=True, RANK_PAD=16, BLOCK=128), 4)
compile_one("bf16", 16, 256, 3)
compile_one("bf16", 64, 64, 1)
compile_one("fp16", 128, 32, 2)
compile_one("fp32", 16, 256, 3)
print("ok")
"""


def test_kernel_compiles_for_hopper_without_spills():
    compile_for_hopper(_COMPILE_SCRIPT)


# ------------------------------------------------------------------ GPU: Llama-3.1-8B shapes

LLAMA8B_GROUPS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
                  "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="Llama-sized shapes only compiled on a GPU")
@pytest.mark.parametrize("num_tokens", [1, 16, 64])
@pytest.mark.parametrize("group", sorted(LLAMA8B_GROUPS))
def test_llama8b_shapes_bf16(group, num_tokens):
    in_size, sizes = LLAMA8B_GROUPS[group]
    g = torch.Generator().manual_seed(num_tokens)
    token_slots = torch.randint(-1, 8, (num_tokens,), generator=g).tolist()
    x, w, weights, out, lora_b, scaling, slots = _case(sizes, 8, 16, token_slots, torch.bfloat16,
                                                       in_size=in_size)
    base = sum(sizes)
    want = out.clone()
    lora_expand_folded_ref(want[:, base:], lora_b, scaling, want[:, :base], slots, sizes)
    got = out.cuda()
    lora_expand_folded(got[:, base:], lora_b.cuda(), scaling.cuda(), got[:, :base], slots.cuda(), sizes)
    torch.testing.assert_close(got[:, :base].cpu(), want[:, :base], rtol=2 * 2**-8, atol=1e-2)

"""Fused LoRA training kernels (LoRAFusion FusedLoRA / FusedMultiLoRA) vs the unfused PEFT reference.

Without CUDA the kernels run on CPU under Triton's interpreter (see tests/_triton_interpret.py for
why the module may rerun itself in a child process); with CUDA the same small cases run compiled,
plus bf16 cases at larger shapes. Forward y and the gradients dX, dA, dB of FusedLoRALinearFunction
are compared with torch.autograd through lora_linear_train_ref (base F.linear + dropout + A/B per
slot, same regenerated dropout mask); W is frozen.

Tolerances: fp32, |fused - ref| <= 1e-4 * max|ref| + 1e-4 * |ref| (the kernels use ieee fp32 dots,
so only summation order differs; observed ~3e-7 relative). bf16 (GPU), vs the fp32 reference of the
same bf16 inputs: <= 3e-2 * max|ref| (bf16 has 8 mantissa bits; y and dX round once at the store,
S and dS round to bf16 before their second GEMM, as PEFT's bf16 path does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from flexserve_kernels.lora.serve.meta import DropoutWindows, LoRAKernelMeta
from flexserve_kernels.lora.train.configs import train_configs

from _triton_interpret import (
    compile_for_hopper,
    import_kernels,
    interpreter_hooks,
    is_interpreted,
    library_is_compiled,
)

_KERNEL_MODULES = ("flexserve_kernels.lora.train.ref", "flexserve_kernels.lora.train.fused",
                   "flexserve_kernels.lora.train.fused_bwd", "flexserve_kernels.lora.train.linear")
ref, fused, fused_bwd, linear = import_kernels(_KERNEL_MODULES, interpret=not torch.cuda.is_available())

INTERPRETED = is_interpreted(fused._lora_train_shrink_fwd_kernel)
DEVICE = "cpu" if INTERPRETED else "cuda"
RUN_IN_CHILD = INTERPRETED and library_is_compiled()


test_module_in_interpreter_child_process, _triton_interpret = interpreter_hooks(
    __file__, INTERPRETED, RUN_IN_CHILD)


@dataclass(frozen=True)
class Case:
    in_size: int  # x's last dimension
    out_size: int  # W's rows
    max_rank: int  # the slots' padded rank
    slot_ranks: tuple[int, ...]  # true rank of each slot's adapter (zero-padded to max_rank)
    dropout_ps: tuple[float, ...]  # dropout probability of each slot
    row_lens: tuple[int, ...]  # tokens of each row of the flat batch
    row_slots: tuple[int, ...]  # slot of each row, -1 = base model only


CASES = {
    # One adapter of rank 1, no dropout, a base-only row; sizes prime to every block.
    "single-r1-p0": Case(33, 45, 1, (1,), (0.0,), (7, 3, 9), (0, -1, 0)),
    # Three adapters of ranks 16, 3, 7 (padded to 16), dropout on two, base rows between them;
    # segments straddle the 16-row tiles.
    "multi-r16.3.7-p0.1": Case(37, 50, 16, (16, 3, 7), (0.1, 0.0, 0.1), (5, 4, 7, 6, 3, 2), (0, -1, 1, 2, 0, -1)),
    # Rank 64 with dropout, one long segment (several row tiles and chunks) and a short one.
    "two-r64.5-p0.1": Case(40, 30, 64, (64, 5), (0.1, 0.1), (35, 2, 4), (1, -1, 0)),
    # Rank 128, the largest the kernels take.
    "single-r128-p0.1": Case(20, 24, 128, (128,), (0.1,), (9,), (0,)),
}


def make_inputs(case: Case, dtype: torch.dtype = torch.float32, device: str = DEVICE, seed: int = 0, scale: int = 1):
    """x, W, stacked A/B (zero-padded ranks), meta, scalings; `scale` multiplies tokens and sizes."""
    g = torch.Generator().manual_seed(seed)
    in_size, out_size = case.in_size * scale, case.out_size * scale
    num_slots = len(case.slot_ranks)
    lora_a = torch.zeros(num_slots, case.max_rank, in_size)
    lora_b = torch.zeros(num_slots, out_size, case.max_rank)
    for slot, rank in enumerate(case.slot_ranks):
        lora_a[slot, :rank] = torch.randn(rank, in_size, generator=g) / math.sqrt(in_size)
        lora_b[slot, :, :rank] = torch.randn(out_size, rank, generator=g) / math.sqrt(rank)
    row_lens = [n * scale for n in case.row_lens]
    x = torch.randn(sum(row_lens), in_size, generator=g)
    weight = torch.randn(out_size, in_size, generator=g) / math.sqrt(in_size)
    scalings = [16.0 / r / (1 + s) for s, r in enumerate(case.slot_ranks)]
    meta = LoRAKernelMeta.build(row_lens, list(case.row_slots), device)
    as_dev = lambda t: t.to(device, dtype)  # noqa: E731
    return as_dev(x), as_dev(weight), as_dev(lora_a), as_dev(lora_b), meta, scalings


def run_both(case: Case, dtype: torch.dtype = torch.float32, seed: int = 11, scale: int = 1, base_gemm: str = "blas"):
    """(fused y, dx, dA, dB), (reference y, dx, dA, dB), the reference in fp32 from the same inputs."""
    x, weight, lora_a, lora_b, meta, scalings = make_inputs(case, dtype, scale=scale)
    slots = fused.LoRATrainSlots.build(scalings, list(case.dropout_ps), x.device)
    leaves = [t.clone().requires_grad_() for t in (x, lora_a, lora_b)]
    y = linear.fused_lora_linear(leaves[0], weight, leaves[1], leaves[2], meta, slots, seed, base_gemm=base_gemm)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.device, dtype)
    y.backward(dy)
    ref_leaves = [t.float().clone().requires_grad_() for t in (x, lora_a, lora_b)]
    y_ref = ref.lora_linear_train_ref(ref_leaves[0], weight.float(), ref_leaves[1], ref_leaves[2], meta.token_slots,
                                      scalings, list(case.dropout_ps), seed)
    y_ref.backward(dy.float())
    # Without adapter tokens the reference never touches A and B: their gradient is zero.
    ref_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ref_leaves]
    return [y] + [t.grad for t in leaves], [y_ref] + ref_grads


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    bound = rel * want.abs().max().item() + rel * want.abs()
    err = (got.float() - want).abs()
    worst, scale = err.max().item(), want.abs().max().item()
    assert bool((err <= bound).all()), f"{name}: max error {worst:.3g} vs max |ref| {scale:.3g}"


@pytest.mark.parametrize("base_gemm", ["blas"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_reference(name, base_gemm):
    got, want = run_both(CASES[name], base_gemm=base_gemm)
    for label, g, w in zip(("y", "dx", "dA", "dB"), got, want):
        assert g.shape == w.shape
        assert_close(f"{name} {label}", g, w, 1e-4)
    # Zero-padded rank columns stay zero: their gradients are exactly zero.
    case = CASES[name]
    for slot, rank in enumerate(case.slot_ranks):
        assert bool((got[2][slot, rank:] == 0).all()) and bool((got[3][slot, :, rank:] == 0).all())


# base_gemm="tma" reads x and W through tensor descriptors, whose rows must start at 16-byte
# boundaries: in and out sizes are multiples of 8 here (bf16 and fp32 alike); tokens stay odd.
TMA_CASE = Case(40, 56, 16, (16, 3, 7), (0.1, 0.0, 0.1), (5, 4, 7, 6, 3, 2), (0, -1, 1, 2, 0, -1))


def test_tma_form_matches_reference():
    got, want = run_both(TMA_CASE, base_gemm="tma")
    for name, g, w in zip(("y", "dx", "dA", "dB"), got, want):
        assert_close(name, g, w, 1e-4)


# Row tiles of 16 over these rows: one adapter (slot 1), slot 1 then none, none at all, one
# adapter (slot 0, two rows of the batch that merge into one segment), then three adapters in a
# partial tile. Kernel 2 adds one product to the tiles of one adapter and walks the segments of
# the mixed ones.
TILE_ROUTING_CASE = Case(40, 64, 16, (16, 3, 7), (0.0, 0.0, 0.0), (20, 28, 12, 9, 5, 3), (1, -1, 0, 0, 2, 1))


@pytest.mark.parametrize("base_gemm, epilogue_split", [("tma", 1), ("tma", 2), ("blas", 1)])
def test_forward_tiles_of_one_adapter_none_and_several_match_torch(base_gemm, epilogue_split):
    # epilogue_split: the TMA form's store in column parts
    from flexserve_kernels.lora.train.fused_tma import linear_fwd_tma

    x, weight, _, lora_b, meta, scalings = make_inputs(TILE_ROUTING_CASE)
    slots = fused.LoRATrainSlots.build(scalings, list(TILE_ROUTING_CASE.dropout_ps), DEVICE)
    s = torch.randn(x.shape[0], TILE_ROUTING_CASE.max_rank, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    token_segs = fused.token_segments(meta)
    want = x.cpu() @ weight.cpu().t()
    for row, slot in enumerate(meta.token_slots.tolist()):
        if slot >= 0:
            want[row] += scalings[slot] * (lora_b[slot].cpu() @ s[row].cpu())
    if base_gemm == "tma":
        got = torch.full_like(want, float("nan")).to(DEVICE)
        linear_fwd_tma(x, weight, s, lora_b, got, token_segs, meta, slots, blocks=(16, 32, 32),
                       epilogue_split=epilogue_split)
    else:
        got = linear.lora_train_linear_fwd(x, weight, s, lora_b, meta, slots, token_segs, base_gemm="blas",
                                          blocks=(16, 32, 32))
    assert_close("y", got.cpu(), want, 1e-5)


@pytest.mark.parametrize("num_tiles, programs, k_blocks, min_part, want", [
    (10, 4, 8, 1, (8, 2, 2)),  # a tail of 2 on 4 programs: 2 K parts each
    (5, 4, 8, 1, (4, 1, 4)),  # a tail of 1: 4 parts (MAX_TAIL_SPLIT)
    (7, 4, 8, 1, (7, 3, 1)),  # a tail of 3: no room for a second part
    (8, 4, 8, 1, (8, 0, 1)),  # full rounds
    (2, 4, 8, 1, (0, 2, 2)),  # fewer tiles than programs: all of them split
    (320, 132, 64, 16, (264, 56, 2)),  # 2048 x 5120 in 128 x 256 x 64 tiles on an H100
    (320, 132, 16, 8, (264, 56, 2)),  # parts of exactly min_part steps
    (320, 132, 8, 16, (320, 56, 1)),  # too few K steps to split
])
def test_tail_plan_splits_only_what_idle_programs_can_take(num_tiles, programs, k_blocks, min_part, want):
    from flexserve_kernels.lora.train.fused_tma import tail_plan_of

    assert tail_plan_of(num_tiles, programs, k_blocks, min_part, DEVICE) == want


@pytest.mark.parametrize("rows, out_size, in_size, split", [(77, 64, 128, 2), (77, 32, 136, 4), (112, 32, 128, 1)])
def test_tma_forward_splits_tail_tiles_over_k(rows, out_size, in_size, split):
    # Kernel 2 over TMA, 16 x 32 x 32 tiles on the interpreter's 4 programs (CUDA: one per SM),
    # parts of at least one K step: 5 x 2 tiles leave a tail of 2 tiles split in 2 parts, 5 x 1 a
    # tail of 1 split in 4 (two steps each of in = 136's five: the last part is empty), 7 x 1 a
    # tail of 3, not split. Rows of two adapters and none. A split sums its parts in another
    # order than one pass over K (two steps each, then the parts), so in the interpreter y differs
    # in the last bits from the unsplit launch exactly when it splits; the counters are zero after.
    from flexserve_kernels.lora.train.fused_tma import linear_fwd_tma

    g = torch.Generator().manual_seed(4)
    x = torch.randn(rows, in_size, generator=g).to(DEVICE)
    weight = torch.randn(out_size, in_size, generator=g).to(DEVICE)
    lora_b = torch.randn(2, out_size, 16, generator=g).to(DEVICE)
    s = torch.randn(rows, 16, generator=g).to(DEVICE)
    meta = LoRAKernelMeta.build([30, 20, rows - 50], [1, -1, 0], DEVICE)
    slots = fused.LoRATrainSlots.build([2.0, 0.5], [0.0, 0.0], DEVICE)
    token_segs = fused.token_segments(meta)
    want = x.cpu().double() @ weight.cpu().double().t()
    for row, slot in enumerate(meta.token_slots.tolist()):
        if slot >= 0:
            want[row] += [2.0, 0.5][slot] * (lora_b[slot].cpu().double() @ s[row].cpu().double())
    got, whole = (torch.full((rows, out_size), float("nan"), device=DEVICE) for _ in range(2))
    linear_fwd_tma(x, weight, s, lora_b, got, token_segs, meta, slots, blocks=(16, 32, 32), min_part_k_blocks=1)
    linear_fwd_tma(x, weight, s, lora_b, whole, token_segs, meta, slots, blocks=(16, 32, 32), min_part_k_blocks=99)
    assert_close("y", got.cpu(), want.float(), 1e-5)
    assert_close("y unsplit", whole.cpu(), want.float(), 1e-5)
    assert not bool(fused.launch_scratch("tma_tail", x.device, 4).any())
    if INTERPRETED:
        assert torch.equal(got, whole) == (split == 1)


def test_launch_scratch_is_cached_zeroed_and_grown_per_owner_and_stream():
    device = torch.device(DEVICE)
    first = fused.launch_scratch("test-owner", device, 10)
    assert first.numel() >= 10 and first.dtype == torch.int32 and not bool(first.any())
    assert fused.launch_scratch("test-owner", device, 5) is first
    assert fused.launch_scratch("test-owner", device, 5000).numel() >= 5000
    assert fused.launch_scratch("test-other", device, 5, torch.float32).dtype == torch.float32
    if device.type == "cuda":
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            assert fused.current_stream_handle(device) == side.cuda_stream
            assert fused.launch_scratch("test-owner", device, 5) is not fused._SCRATCH[
                ("test-owner", device, torch.cuda.default_stream(device).cuda_stream, torch.int32)]
        assert fused.current_stream_handle(device) == torch.cuda.current_stream(device).cuda_stream


def test_tma_form_rejects_unaligned_rows_and_wide_ranks():
    x, weight, lora_a, lora_b, meta, scalings = make_inputs(CASES["single-r1-p0"])  # in = 33: 132-byte rows
    slots = fused.LoRATrainSlots.build(scalings, [0.0], x.device)
    with pytest.raises(ValueError, match="16-byte"):
        linear.fused_lora_linear(x, weight, lora_a, lora_b, meta, slots, 0, base_gemm="tma")
    x, weight, lora_a, lora_b, meta, scalings = make_inputs(CASES["single-r128-p0.1"])  # aligned, rank 128
    slots = fused.LoRATrainSlots.build(scalings, [0.1], x.device)
    with pytest.raises(ValueError, match="ranks up to 32"):
        linear.fused_lora_linear(x, weight, lora_a, lora_b, meta, slots, 0, base_gemm="tma")


@pytest.mark.parametrize("num_splits, key_table, seed", [(1, True, 1234), (3, True, 2**32 - 5), (2, False, 1234)])
def test_shrink_applies_the_reference_dropout_mask(num_splits, key_table, seed):
    # A = identity makes S = dropout(x) itself: the kernel's mask is the reference hash, per slot p
    # (p = 0 next to slots with dropout, and the largest fp32 p below 1, where the shifted keep
    # threshold is at its widest), split over in_size or not, column keys mixed or loaded, and a
    # seed of 2**31 or more.
    num_tokens, in_size = 34, 48
    g = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, in_size, generator=g).to(DEVICE)
    ps = [0.1, 0.5, 0.0, 1 - 2**-24]
    lora_a = torch.eye(in_size).repeat(len(ps), 1, 1).to(DEVICE)
    meta = LoRAKernelMeta.build([10, 3, 10, 6, 5], [0, -1, 1, 2, 3], DEVICE)
    slots = fused.LoRATrainSlots.build([1.0] * len(ps), ps, DEVICE)
    s = fused.lora_train_shrink_fwd(x, lora_a, meta, slots, seed=seed, block_m=16, block_k=16, num_splits=num_splits,
                                    key_table=key_table)
    for rows, p in ((slice(0, 10), 0.1), (slice(13, 23), 0.5), (slice(23, 29), 0.0), (slice(29, 34), ps[3])):
        keep = ref.dropout_keep_ref(seed, num_tokens, in_size, p, DEVICE)[rows]
        torch.testing.assert_close(s[rows], x[rows] * keep / (1 - p), rtol=1e-6, atol=1e-6)
        if 0 < p < 0.9:
            assert 0 < int((~keep).sum()) < keep.numel()
    assert bool((s[10:13] == 0).all())  # base rows
    torch.testing.assert_close(s, ref.lora_train_shrink_ref(x, lora_a, meta.token_slots, ps, seed))


# Kernel 1 split over in_size: three adapters of ranks 16, 5, 9 (dropout 0.1, 0, 0.5) with base
# rows between them; in = 77 is 5 blocks of 16 columns, the last partial; segments of 20 and 18
# tokens take two 16-row tiles each.
SPLIT_CASE = Case(77, 1, 16, (16, 5, 9), (0.1, 0.0, 0.5), (20, 3, 9, 18, 4), (0, -1, 1, 2, -1))


def shrink_split_check(case: Case, num_splits: int, want_splits: int, seed: int = 21, **kwargs) -> torch.Tensor:
    """S of `case` with num_splits requested: the plan's split count, the reference within fp32
    tolerance, base rows and padded rank columns exactly zero, the same bits on a second call (the
    tile counters are back to zero) and with the column keys mixed in the kernel instead of loaded."""
    x, _, lora_a, _, meta, scalings = make_inputs(case)
    slots = fused.LoRATrainSlots.build(scalings, list(case.dropout_ps), DEVICE)
    k_per_split, splits = fused.shrink_split_plan(meta, case.in_size, case.max_rank, 16, 16, x.device, 4, num_splits)
    assert splits == want_splits and k_per_split % 16 == 0
    assert (splits - 1) * k_per_split < case.in_size <= splits * k_per_split
    run = lambda **more: fused.lora_train_shrink_fwd(x, lora_a, meta, slots, seed, block_m=16, block_k=16,  # noqa: E731
                                                     num_splits=num_splits, **kwargs, **more)
    s = run()
    assert s.shape == (x.shape[0], case.max_rank) and s.dtype == x.dtype
    assert_close("S", s, ref.lora_train_shrink_ref(x, lora_a, meta.token_slots, list(case.dropout_ps), seed), 1e-4)
    assert bool((s[meta.token_slots < 0] == 0).all())
    for slot, rank in enumerate(case.slot_ranks):
        assert bool((s[meta.token_slots == slot, rank:] == 0).all())
    assert torch.equal(run(), s)
    assert torch.equal(run(key_table=False), s)
    assert not bool(fused.launch_scratch("shrink", x.device, x.shape[0]).any())
    return s


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
def test_split_shrink_matches_reference(num_splits):
    shrink_split_check(SPLIT_CASE, num_splits, num_splits)


def test_split_shrink_splits_no_finer_than_block_k():
    # More splits asked than in_size has column blocks: one block per split (in = 20: two), or
    # the unsplit kernel (in = 12, less than one block).
    shrink_split_check(Case(20, 1, 16, (16, 7), (0.1, 0.5), (17, 2, 5), (0, -1, 1)), 4, 2)
    shrink_split_check(Case(12, 1, 8, (8,), (0.1,), (9,), (0,)), 3, 1)


@pytest.mark.parametrize("name", ["single-r1-p0", "two-r64.5-p0.1", "single-r128-p0.1"])
def test_split_shrink_ranks_1_to_128(name):
    shrink_split_check(CASES[name], 2, 2)  # in = 33, 40, 20: two or three column blocks


def test_split_plan_rule():
    # The default split count: row tiles x splits near target_programs(device, per_sm) (8 per_sm
    # under the interpreter), at most one block_k per split, and partials within in / (16 r) splits.
    cpu = torch.device("cpu")
    one = LoRAKernelMeta.build([64], [0], "cpu")  # 4 tiles of 16 rows
    assert fused.shrink_split_plan(one, 4096, 16, 16, 128, cpu, 4) == (512, 8)  # 32 programs / 4 tiles
    assert fused.shrink_split_plan(one, 4096, 16, 16, 128, cpu, 2) == (1024, 4)
    assert fused.shrink_split_plan(one, 4096, 128, 16, 128, cpu, 4) == (2048, 2)  # 4096 / (16 x 128)
    assert fused.shrink_split_plan(one, 200, 1, 16, 128, cpu, 4) == (128, 2)  # two column blocks
    assert fused.shrink_split_plan(one, 200, 16, 16, 128, cpu, 4) == (256, 1)  # 200 / (16 x 16) < 1
    many = LoRAKernelMeta.build([300, 4, 300], [0, -1, 1], "cpu")  # 2 x 19 tiles: enough already
    assert fused.shrink_split_plan(many, 4096, 16, 16, 128, cpu, 4) == (4096, 1)
    # Many short segments: tiles bounded by the tokens, not segments x the longest segment's tiles.
    rows = LoRAKernelMeta.build([40] + [1] * 20, [0] + [1, 2] * 10, "cpu")  # 23 tiles (24 counted)
    assert fused.shrink_split_plan(rows, 4096, 16, 16, 128, cpu, 4) == (4096, 1)
    assert fused.shrink_split_plan(rows, 4096, 16, 16, 128, cpu, 8) == (2048, 2)


# Kernel 1's row windows (the fine-tuning engine's forward): segments of slots 0, 1, 2 with base rows
# between; window 0 covers part of slot 0's segment (rows 2-11), window 1 all of slot 1's (15-24)
# and window 2 base rows and the start of slot 2's segment (25-30). Three groups (the engine's
# (layer, target) pairs), each with its own seeds (one of 2**31 or more) and p (0 in some).
WINDOW_ROWS, WINDOW_SLOTS = [12, 3, 10, 2, 9], [0, -1, 1, -1, 2]
WINDOW_BOUNDS = [(2, 10), (15, 10), (25, 6)]
WINDOW_SEEDS = [[11, 2**32 - 7, 5], [2**31 + 3, 12, 13], [21, 22, 23]]
WINDOW_PS = [[0.1, 0.5, 0.25], [0.0, 0.3, 1 - 2**-24], [0.2, 0.0, 0.0]]


def window_shrink(x, lora_a, meta, windows, group, **kwargs):
    """`lora_window_shrink_fwd`, or with launcher keywords (tiles, splits) the launcher it calls."""
    if not kwargs:
        return fused.lora_window_shrink_fwd(x, lora_a, meta, windows, group)
    return fused.lora_train_shrink_fwd(x, lora_a, meta, None, 0, windows=(windows, group), out_dtype=torch.float32,
                                       **kwargs)


@pytest.mark.parametrize("kwargs", [{}, dict(block_m=16, block_k=16, num_splits=3),
                                    dict(block_m=16, block_k=16, num_splits=1, key_table=False)])
def test_window_shrink_applies_each_windows_mask(kwargs):
    # A = identity makes S = dropout(x) itself: every window's rows carry the reference mask of its
    # own seed and p in the group, with the window's first row hashed as row 0; rows outside the
    # windows keep x; base rows are zero.
    in_size = 40
    g = torch.Generator().manual_seed(4)
    meta = LoRAKernelMeta.build(WINDOW_ROWS, WINDOW_SLOTS, DEVICE)
    x = torch.randn(meta.num_tokens, in_size, generator=g).to(DEVICE)
    lora_a = torch.eye(in_size).repeat(3, 1, 1).to(DEVICE)
    windows = DropoutWindows.build(WINDOW_BOUNDS, WINDOW_SEEDS, WINDOW_PS, DEVICE)
    assert windows.num_windows == 3 and windows.num_groups == 3 and windows.has_dropout
    base = meta.token_slots < 0
    for group in range(3):
        s = window_shrink(x, lora_a, meta, windows, group, **kwargs)
        assert s.dtype == torch.float32 and s.shape == (meta.num_tokens, in_size)
        want = x.clone()
        for (first, count), seed, p in zip(WINDOW_BOUNDS, WINDOW_SEEDS[group], WINDOW_PS[group]):
            keep = ref.dropout_keep_ref(seed, count, in_size, p, DEVICE)
            want[first:first + count] = x[first:first + count] * keep / (1 - p)
            if 0 < p < 0.9:
                assert 0 < int((~keep).sum()) < keep.numel()
        want[base] = 0
        torch.testing.assert_close(s, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s, ref.lora_window_shrink_ref(x, lora_a, meta, windows, group), rtol=1e-6,
                                   atol=1e-6)
    assert not bool(fused.launch_scratch("shrink", x.device, x.shape[0]).any())


def test_window_shrink_ranks_and_no_dropout():
    # Real adapters (ranks 16, 5 and 1 in slots of 16) against the reference; with every p 0 the
    # windows change nothing: S is the plain shrink (`lora_shrink_ref`).
    from flexserve_kernels.lora.serve.ref import lora_shrink_ref

    in_size, max_rank = 72, 16
    g = torch.Generator().manual_seed(6)
    meta = LoRAKernelMeta.build(WINDOW_ROWS, WINDOW_SLOTS, DEVICE)
    x = torch.randn(meta.num_tokens, in_size, generator=g).to(DEVICE)
    lora_a = torch.zeros(3, max_rank, in_size)
    for slot, rank in enumerate((16, 5, 1)):
        lora_a[slot, :rank] = torch.randn(rank, in_size, generator=g) / in_size**0.5
    lora_a = lora_a.to(DEVICE)
    windows = DropoutWindows.build(WINDOW_BOUNDS, WINDOW_SEEDS, WINDOW_PS, DEVICE)
    for group in range(3):
        for kwargs in ({}, dict(block_m=16, block_k=16, num_splits=2)):
            s = window_shrink(x, lora_a, meta, windows, group, **kwargs)
            assert_close(f"S group {group} {kwargs}", s, ref.lora_window_shrink_ref(x, lora_a, meta, windows, group),
                         1e-5)
    none = DropoutWindows.build(WINDOW_BOUNDS, WINDOW_SEEDS, [[0.0] * 3] * 3, DEVICE)
    assert not none.has_dropout
    assert_close("S without dropout", window_shrink(x, lora_a, meta, none, 1), lora_shrink_ref(x, lora_a, meta), 1e-5)


def test_dropout_windows_bad_input():
    with pytest.raises(ValueError, match="overlap"):
        DropoutWindows.build([(0, 5), (4, 3)], [[1, 2]], [[0.1, 0.1]], "cpu")
    with pytest.raises(ValueError, match="probabilities"):
        DropoutWindows.build([(0, 5)], [[1]], [[1.0]], "cpu")
    with pytest.raises(ValueError, match="seeds"):
        DropoutWindows.build([(0, 5)], [[2**32]], [[0.1]], "cpu")
    with pytest.raises(ValueError, match="non-negative"):
        DropoutWindows.build([(-1, 5)], [[1]], [[0.1]], "cpu")
    with pytest.raises(ValueError, match="at least one"):
        DropoutWindows.build([], [], [], "cpu")
    windows = DropoutWindows.build([(0, 5)], [[1], [2]], [[0.1], [0.2]], DEVICE)
    meta = LoRAKernelMeta.build([5], [0], DEVICE)
    x, lora_a = torch.randn(5, 8).to(DEVICE), torch.randn(1, 4, 8).to(DEVICE)
    with pytest.raises(ValueError, match="group 2"):
        fused.lora_window_shrink_fwd(x, lora_a, meta, windows, 2)
    from flexserve_kernels.lora.serve.ops import lora_window_shrink

    with pytest.raises(ValueError, match="ranks up to 128"):  # kernel 1's widest slot
        lora_window_shrink(x, torch.zeros(1, 129, 8).to(DEVICE), meta, windows, 0)


def test_reference_mask_keeps_one_minus_p_and_depends_on_seed():
    keep = ref.dropout_keep_ref(7, 512, 256, 0.1)
    assert abs(keep.float().mean().item() - 0.9) < 0.005
    assert not torch.equal(keep, ref.dropout_keep_ref(8, 512, 256, 0.1))
    assert torch.equal(keep, ref.dropout_keep_ref(7, 512, 256, 0.1))


def test_reference_mask_has_no_pair_structure():
    """Neighbours drop independently: the joint drop rate of adjacent columns, rows and diagonals
    is p^2, and the parity of a 2x2 block (which an xor of row and column keys alone would fix at
    0) has its independent value. Measured at 4096 x 4096,
    seeds 0, 1 and 12345: within 1e-4 of p^2 and 4e-4 of the parity's."""
    p = 0.1
    for seed in (0, 3):
        d = (~ref.dropout_keep_ref(seed, 2048, 2048, p)).float()
        assert abs(d.mean().item() - p) < 2e-3
        for pair in (d[:, 1:] * d[:, :-1], d[1:] * d[:-1], d[1:, 1:] * d[:-1, :-1]):
            assert abs(pair.mean().item() - p * p) < 6e-4
        parity = (d[1:, 1:] + d[:-1, :-1] + d[1:, :-1] + d[:-1, 1:]) % 2
        assert abs(parity.mean().item() - (4 * p * (1 - p) ** 3 + 4 * p ** 3 * (1 - p))) < 3e-3


def test_seed_changes_output_only_with_dropout():
    case = CASES["multi-r16.3.7-p0.1"]
    x, weight, lora_a, lora_b, meta, scalings = make_inputs(case)
    with_dropout = fused.LoRATrainSlots.build(scalings, list(case.dropout_ps), DEVICE)
    no_dropout = fused.LoRATrainSlots.build(scalings, [0.0] * len(scalings), DEVICE)
    y = [linear.fused_lora_linear(x, weight, lora_a, lora_b, meta, slots, seed)
         for slots in (with_dropout, no_dropout) for seed in (1, 2)]
    assert not torch.equal(y[0], y[1])
    assert torch.equal(y[2], y[3])


def test_term_da_chunks_rule():
    # 16 row chunks only for the lean one pass (16-bit term, dS in one half) and only while
    # segments x 16 x column tiles fit target_programs(device, per_sm) (8 per SM on the CPU).
    cpu = torch.device("cpu")
    one, two = LoRAKernelMeta.build([64], [0], "cpu"), LoRAKernelMeta.build([32, 32], [0, 1], "cpu")
    assert fused_bwd.term_da_chunks(one, 256, 128, cpu, 4, lean=True) == 16  # 16 x 2 tiles = 32 programs
    assert fused_bwd.term_da_chunks(one, 384, 128, cpu, 4, lean=True) == 8  # 48 > 32
    assert fused_bwd.term_da_chunks(two, 256, 128, cpu, 4, lean=True) == 8  # 2 segments: 64 > 32
    assert fused_bwd.term_da_chunks(two, 256, 128, cpu, 8, lean=True) == 16
    assert fused_bwd.term_da_chunks(one, 256, 128, cpu, 4, lean=False) == 8  # the engine's form


def test_chunked_backward_with_small_blocks():
    # Tiny blocks force several row chunks per segment, several column splits and masked tails.
    case = CASES["two-r64.5-p0.1"]
    x, weight, lora_a, lora_b, meta, scalings = make_inputs(case)
    slots = fused.LoRATrainSlots.build(scalings, list(case.dropout_ps), DEVICE)
    s = fused.lora_train_shrink_fwd(x, lora_a, meta, slots, 9, block_m=16, block_k=16)
    dy = torch.randn(x.shape[0], case.out_size, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ds, db = fused_bwd.lora_train_ds_db_bwd(dy, lora_b, s, meta, slots, block_m=16, block_n=16)
    plan = fused_bwd.chunk_plan(meta, case.out_size, 16, 16, torch.device(DEVICE))
    assert plan[1] > 1 and plan[3] > 1  # chunks, splits
    rows = meta.token_slots >= 0
    want_ds = torch.zeros_like(ds)
    for slot, scaling in enumerate(scalings):
        mine = meta.token_slots == slot
        want_ds[mine] = scaling * dy[mine] @ lora_b[slot]
        assert_close(f"dB[{slot}]", db[slot], scaling * dy[mine].T @ s[mine], 1e-4)
    assert_close("dS", ds, want_ds, 1e-4)
    assert bool((ds[~rows] == 0).all())
    da = fused_bwd.lora_train_da_bwd(x, ds, lora_a, meta, slots, 9, block_m=16, block_k=16)
    for slot, p in enumerate(case.dropout_ps):
        mine = meta.token_slots == slot
        dropped = x * ref.dropout_keep_ref(9, x.shape[0], case.in_size, p, DEVICE) / (1 - p)
        assert_close(f"dA[{slot}]", da[slot], ds[mine].T @ dropped[mine], 1e-4)


def test_kernel_seed_keeps_the_seed_bits_in_one_int32():
    # Seeds of 2**31 or more would reach Triton as int64 (another compiled variant); the kernels
    # get the int32 of the same 32 bits, which their hash adds mod 2**32 (the masks of such seeds
    # are checked against the reference in test_shrink_applies_the_reference_dropout_mask).
    assert [fused.kernel_seed(s) for s in (0, 5, 2**31 - 1, 2**31, 2**32 - 1)] == [0, 5, 2**31 - 1, -2**31, -1]


def test_outputs_are_not_zeroed_when_every_row_has_an_adapter(monkeypatch):
    # Kernel 3's dS partials and the one pass's dX term start unwritten (no fill) when every row
    # has an adapter: each split's first column tile of dS stores, the rest add; every term
    # element is stored. Fresh buffers are poisoned with NaN here.
    case = Case(20, 1600, 8, (8,), (0.1,), (40,), (0,))
    x, _, lora_a, lora_b, meta, scalings = make_inputs(case)
    slots = fused.LoRATrainSlots.build(scalings, list(case.dropout_ps), DEVICE)
    g = torch.Generator().manual_seed(6)
    s = torch.randn(40, case.max_rank, generator=g).to(DEVICE)
    dy = torch.randn(40, case.out_size, generator=g).to(DEVICE)
    plan = fused_bwd.chunk_plan(meta, case.out_size, 16, 16, torch.device(DEVICE), per_sm=1)
    assert plan[2] > 16 and plan[3] > 1  # several column tiles per split, several splits
    ds = torch.randn(40, case.max_rank, generator=g).to(DEVICE)
    want_term = fused_bwd.lora_train_dx_term(ds, lora_a, meta, slots, 3)
    want_da = fused_bwd.lora_train_da_bwd(x, ds, lora_a, meta, slots, 3)
    poison = lambda t: t.fill_(float("nan")) if t.is_floating_point() else t  # noqa: E731
    for name in ("empty", "empty_like"):  # dA's and dB's buffers too: the slot reduction writes them whole
        monkeypatch.setattr(torch, name, (lambda alloc: lambda *a, **k: poison(alloc(*a, **k)))(getattr(torch, name)))
    term, da = fused_bwd.lora_train_dx_term_da_bwd(x, ds, lora_a, meta, slots, 3, out_dtype=torch.float32)
    assert torch.equal(term, want_term)
    assert_close("dA", da, want_da, 1e-4)  # the same sums, in other tiles on CUDA
    ds, db = fused_bwd.lora_train_ds_db_bwd(dy, lora_b, s, meta, slots, block_m=16, block_n=16, per_sm=1)
    assert_close("dS", ds, scalings[0] * dy @ lora_b[0], 1e-4)
    assert_close("dB", db[0], scalings[0] * dy.T @ s, 1e-4)


def test_slots_the_batch_does_not_use_get_zero_gradients(monkeypatch):
    # dA and dB of a slot without tokens are zero though their buffers start as NaN; slot 0 has two
    # segments, whose partials add up, slot 1 none.
    case = Case(37, 50, 16, (16, 3, 7), (0.1, 0.0, 0.1), (5, 4, 7, 6), (0, -1, 2, 0))
    x, weight, lora_a, lora_b, meta, scalings = make_inputs(case)
    slots = fused.LoRATrainSlots.build(scalings, list(case.dropout_ps), DEVICE)
    s = fused.lora_train_shrink_fwd(x, lora_a, meta, slots, 4, block_m=16, block_k=16)
    dy = torch.randn(x.shape[0], case.out_size, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))
    ds, db = fused_bwd.lora_train_ds_db_bwd(dy, lora_b, s, meta, slots, block_m=16, block_n=16, per_sm=1)
    term, da = fused_bwd.lora_train_dx_term_da_bwd(x, ds, lora_a, meta, slots, 4, block_m=16, block_k=16, per_sm=1)
    assert not bool(db[1].any()) and not bool(da[1].any())
    for slot in (0, 2):
        mine = meta.token_slots == slot
        dropped = x * ref.dropout_keep_ref(4, x.shape[0], case.in_size, case.dropout_ps[slot], DEVICE)
        assert_close(f"dB[{slot}]", db[slot], scalings[slot] * dy[mine].T @ s[mine], 1e-4)
        assert_close(f"dA[{slot}]", da[slot], ds[mine].T @ dropped[mine] / (1 - case.dropout_ps[slot]), 1e-4)


def test_sum_parts_adds_in_index_order():
    # 19 parts: two full groups of SUM_UNROLL loads and a ragged one; 700 elements: a partial
    # block. The same bits as adding them one after another in fp32.
    part = torch.randn(19, 7, 100, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    want = torch.zeros(7, 100, device=DEVICE)
    for p in part:
        want += p
    assert torch.equal(fused_bwd.sum_parts(part), want)


@pytest.mark.parametrize("split_ds", [False, True])
@pytest.mark.parametrize("x_dropped", [False, True])
@pytest.mark.parametrize("name", ["multi-r16.3.7-p0.1", "two-r64.5-p0.1", "single-r128-p0.1"])
def test_dx_term_and_da_in_one_pass_match_their_kernels(name, x_dropped, split_ds):
    # Kernels 4's term and 5 fused (one walk over the [T, in] tiles, one mask per tile) against
    # each alone, with small blocks (several row chunks and column splits, masked tails), dA added
    # to a buffer, rows without an adapter (zero term rows), and x taken as already dropped. Rank
    # 128 is above MAX_TERM_DA_RANK: the two kernels run, with the same results.
    case = CASES[name]
    x, _, lora_a, _, meta, scalings = make_inputs(case)
    slots = fused.LoRATrainSlots.build(scalings, list(case.dropout_ps), DEVICE)
    ds = torch.randn(x.shape[0], case.max_rank, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ds[meta.token_slots < 0] = 0  # as kernel 3 leaves them
    da_slots = fused.LoRATrainSlots.build(scalings, [0.0] * len(scalings), DEVICE) if x_dropped else slots
    want_da = fused_bwd.lora_train_da_bwd(x, ds, lora_a, meta, da_slots, 9, block_m=16, block_k=16,
                                          split_ds=split_ds).float()
    want_term = fused_bwd.lora_train_dx_term(ds, lora_a, meta, slots, 9, split_ds=split_ds)
    start = torch.randn(lora_a.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    da_out = start.clone()
    term, da = fused_bwd.lora_train_dx_term_da_bwd(x, ds, lora_a, meta, slots, 9, out_dtype=torch.float32,
                                                   split_ds=split_ds, x_dropped=x_dropped, da_out=da_out,
                                                   block_m=16, block_k=16)
    assert da is da_out and term.dtype == torch.float32
    if INTERPRETED:  # the interpreter's dots sum each tile shape in its own order
        assert_close("term", term, want_term, 1e-6)
    else:
        assert torch.equal(term, want_term)  # the same arithmetic as kernel 4's term
    assert_close("dA", da - start, want_da, 1e-4)
    assert bool((term[meta.token_slots < 0] == 0).all())
    # Meta built by hand without the adapter token count: the term is zeroed first all the same.
    meta.num_lora_tokens = None
    term, da = fused_bwd.lora_train_dx_term_da_bwd(x, ds, lora_a, meta, slots, 9, out_dtype=torch.float32,
                                                   split_ds=split_ds, x_dropped=x_dropped)
    if INTERPRETED:  # the interpreter's dots sum each tile shape in its own order
        assert_close("term", term, want_term, 1e-6)
    else:
        assert torch.equal(term, want_term)  # the same arithmetic as kernel 4's term
    assert_close("dA", da, want_da, 1e-4)


def test_invalid_arguments_raise_value_error():
    case = CASES["single-r1-p0"]
    x, weight, lora_a, lora_b, meta, scalings = make_inputs(case)
    slots = fused.LoRATrainSlots.build(scalings, [0.0], DEVICE)
    with pytest.raises(ValueError, match="frozen"):
        linear.fused_lora_linear(x, weight.clone().requires_grad_(), lora_a, lora_b, meta, slots, 0)
    with pytest.raises(ValueError, match="lora_b"):
        linear.fused_lora_linear(x, weight, lora_a, lora_b[:, :-1], meta, slots, 0)
    with pytest.raises(ValueError, match="seed"):
        linear.fused_lora_linear(x, weight, lora_a, lora_b, meta, slots, -1)
    with pytest.raises(ValueError, match="base_gemm"):
        linear.fused_lora_linear(x, weight, lora_a, lora_b, meta, slots, 0, base_gemm="cutlass")
    with pytest.raises(ValueError, match="dropout"):
        fused.LoRATrainSlots.build([1.0], [1.0], DEVICE)
    with pytest.raises(ValueError, match="slot configs"):
        linear.fused_lora_linear(x, weight, lora_a, lora_b, meta, fused.LoRATrainSlots.build([1.0] * 2, [0.0] * 2,
                                                                                          DEVICE), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("base_gemm", ["blas", "tma", "auto"])
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_gpu_matches_reference(name, base_gemm):
    if base_gemm == "tma" and CASES[name].max_rank > 32:
        pytest.skip("base_gemm='tma' takes ranks up to 32")
    got, want = run_both(CASES[name], torch.bfloat16, scale=8, base_gemm=base_gemm)
    for label, g, w in zip(("y", "dx", "dA", "dB"), got, want):
        assert g.dtype == torch.bfloat16
        assert_close(f"{name} {label}", g, w, 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("base_gemm", ["blas", "tma", "auto"])
def test_bf16_gpu_autotuned_tiles_four_adapters(base_gemm):
    # Autotuned 64-256-wide tiles over 4 adapters (ranks 16, 8, 16, 4), base rows between them.
    case = Case(128, 96, 16, (16, 8, 16, 4), (0.1, 0.0, 0.05, 0.1), (70, 9, 61, 33, 50), (0, -1, 1, 2, 3))
    got, want = run_both(case, torch.bfloat16, scale=8, base_gemm=base_gemm)
    for label, g, w in zip(("y", "dx", "dA", "dB"), got, want):
        assert_close(f"4 adapters {label}", g, w, 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_rank", [16, 128])
def test_gpu_split_shrink_bf16_is_reproducible(max_rank):
    # The CUDA default (split-K, row tiles' last programs summing partials in split order) at bf16
    # against the fp32 reference, over many repeated launches whose programs finish in any
    # order: the same bits every time, and the same as other split counts within bf16 rounding.
    case = Case(4096, 1, max_rank, (max_rank, 8, 3), (0.1, 0.0, 0.5), (700, 30, 500, 300, 9),
                (0, -1, 1, 2, -1))
    x, _, lora_a, _, meta, scalings = make_inputs(case, torch.bfloat16)
    slots = fused.LoRATrainSlots.build(scalings, list(case.dropout_ps), DEVICE)
    want = ref.lora_train_shrink_ref(x, lora_a, meta.token_slots, list(case.dropout_ps), 5)
    first = fused.lora_train_shrink_fwd(x, lora_a, meta, slots, 5)
    assert_close("S", first, want, 3e-2)
    assert bool((first[meta.token_slots < 0] == 0).all())
    assert all(torch.equal(fused.lora_train_shrink_fwd(x, lora_a, meta, slots, 5), first) for _ in range(20))
    assert not bool(fused.launch_scratch("shrink", x.device, x.shape[0]).any())
    for kwargs in (dict(num_splits=1), dict(num_splits=3, block_m=32), dict(per_sm=8, key_table=False)):
        assert_close(f"S {kwargs}", fused.lora_train_shrink_fwd(x, lora_a, meta, slots, 5, **kwargs), want, 3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_gradients_are_bitwise_reproducible():
    runs = [run_both(CASES["multi-r16.3.7-p0.1"], torch.bfloat16, scale=16)[0] for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


_COMPILE_SCRIPT = r"""
import json

import triton
from triton.compiler import ASTSource
from flexserve_kernels.lora.train.configs import CONFIGS_DIR
from flexserve_kernels.tuned_configs import by_rank, load_configs
from flexserve_kernels.lora.train import fused as kf
from flexserve_kernels.lora.train import fused_bwd as kb
from flexserve_kernels.lora.train import fused_tma as kt

FP32 = {"dropout_ps_ptr", "scalings_ptr", "ds_part_ptr", "db_part_ptr", "da_part_ptr", "part_ptr", "ds_ptr"}
# kernel 1's counters, keys, windows; slots
I32 = {"count_ptr", "keys_ptr", "win_bounds_ptr", "win_table_ptr", "token_slots_ptr"}

COMPILED = set()

def compile_one(fn, consts, num_warps, num_stages, gemm=False, descs=None, stream=False, fp32=()):
    key = (fn.__name__, tuple(sorted(consts.items())), num_warps, num_stages, gemm, stream, tuple(sorted(fp32)))
    if key in COMPILED:  # the same launch from another table or file
        return
    COMPILED.add(key)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        if name.endswith("_desc"):  # base_gemm="tma": a tensor descriptor of the config's block
            rows, cols = kt._block_shape(consts, descs[name])
            sig[name] = f"tensordesc<bf16[{rows}, {cols}]>"
            continue
        if name.endswith("_ptr"):
            sig[name] = "*fp32" if name in FP32 or name in fp32 else "*i32" if "seg" in name or name in I32 else "*bf16"
        else:
            sig[name] = "i32"
        # 16-aligned pointers, sizes and strides (Llama's)
        if name not in ("seed", "max_rank", "num_programs", "num_splits", "num_windows", "win_group"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=target,
                            options={"num_warps": num_warps, "num_stages": num_stages})
    ttgir = kernel.asm["ttgir"]
    copy = "async_tma_copy_global_to_local" if descs else "async_copy_global_to_local"
    if gemm and (copy not in ttgir or "warp_group_dot" not in ttgir):
        sys.exit(f"{fn.__name__} {consts}: the main loop is not pipelined onto wgmma")
    if stream and "async_copy_global_to_local" not in ttgir:
        sys.exit(f"{fn.__name__} {consts}: the main loop's loads are not pipelined")
    check_spills(kernel, f"{fn.__name__} {consts} warps={num_warps}")

# Each Hopper configs file's settings (files with the same settings compile once).
HOPPER = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
for C in {json.dumps(c, sort_keys=True): c for c in (load_configs(CONFIGS_DIR, name) for name in HOPPER)}.values():
    # The LoRA terms alone (base_gemm="blas"), at ranks 16 and 128.
    for op, fn, extra in (("lora_train_linear_fwd_term", kf._lora_train_linear_fwd_kernel, {}),
                          ("lora_train_dx_bwd_term", kb._lora_train_dx_bwd_kernel,
                           {"HAS_DROPOUT": True, "SPLIT_DS": False})):
        for i, c in enumerate(kf.gemm_configs(C[op]["candidates"])):
            # the candidates kept above rank 32
            for rank in (16, 32) + ((64, 128) if i < C[op]["wide_rank_candidates"] else ()):
                compile_one(fn, dict(c.kwargs, BLOCK_R=rank, **extra), c.num_warps, c.num_stages)
    # Kernel 1 as the launcher runs it on CUDA, by rank: split over in_size and not (the split
    # count is a runtime argument), column keys loaded or mixed in the kernel, and without dropout;
    # and the engine's form (each row's dropout from its window, S in fp32); x streamed through cp.async.
    shrink = C["lora_train_shrink_fwd"]
    for rank in (16, 32, 64, 128):
        warps = kf.shrink_warps(shrink["block_m"], rank)
        tiles = dict(BLOCK_M=shrink["block_m"], BLOCK_R=rank, BLOCK_K=shrink["block_k"])
        for split in (True, False):
            for key_table in (True, False):
                compile_one(kf._lora_train_shrink_fwd_kernel,
                            dict(HAS_DROPOUT=True, SPLIT=split, KEY_TABLE=key_table, ROW_WINDOWS=False, **tiles),
                            warps, shrink["num_stages"], stream=True)
            compile_one(kf._lora_train_shrink_fwd_kernel,
                        dict(HAS_DROPOUT=True, SPLIT=split, KEY_TABLE=True, ROW_WINDOWS=True, **tiles),
                        kf.shrink_warps(shrink["block_m"], rank, True), shrink["num_stages"], stream=True,
                        fp32={"s_ptr"})
        compile_one(kf._lora_train_shrink_fwd_kernel,
                    dict(HAS_DROPOUT=False, SPLIT=True, KEY_TABLE=False, ROW_WINDOWS=False, **tiles),
                    warps, shrink["num_stages"], stream=True)
    # Kernels 3 and 5 with the launchers' CUDA blocks and warps, by rank.
    for rank in (16, 32, 128):
        for op in ("lora_train_ds_db_bwd", "lora_train_ds_db_bwd_fp32"):
            t = by_rank(C[op]["by_rank"], rank)
            compile_one(kb._lora_train_ds_db_bwd_kernel, dict(BLOCK_M=t["block_m"], BLOCK_N=t["block_n"],
                                                              BLOCK_R=rank), t["num_warps"], 3)
        t = by_rank(C["lora_train_da_bwd"]["by_rank"], rank)
        for split_ds in (False, True):  # True: the fine-tuning engine's dS in two bf16 halves
            compile_one(kb._lora_train_da_bwd_kernel,
                        dict(WITH_TERM=False, HAS_DROPOUT=True, MASK_X=True, SPLIT_DS=split_ds, BLOCK_M=t["block_m"],
                             BLOCK_K=t["block_k"], BLOCK_R=rank), t["num_warps"], 3)
        # The engine's dX term (`lora_train_dx_term`, dS split in two).
        t = by_rank(C["lora_train_dx_term"]["by_rank"], rank)
        compile_one(kb._lora_train_dx_bwd_kernel, dict(HAS_DROPOUT=True, SPLIT_DS=True, BLOCK_M=t["block_m"],
                                                       BLOCK_N=t["block_n"], BLOCK_K=16, BLOCK_R=rank, GROUP_M=4),
                    t["num_warps"], 1)
        # The engine's forward term (`lora_linear_term`, S in fp32).
        t = by_rank(C["lora_linear_term"]["by_rank"], rank)
        compile_one(kf._lora_train_linear_fwd_kernel, dict(BLOCK_M=t["block_m"], BLOCK_N=t["block_n"], BLOCK_K=16,
                                                           BLOCK_R=rank, GROUP_M=4), t["num_warps"], 1,
                    fp32={"s_ptr"})
    # 4's term and 5 in one pass, with the launcher's tiles, up to the rank it takes.
    for rank in (16, 32, kb.MAX_TERM_DA_RANK):
        for split_ds in (False, True):
            bm, bk, w = kb.term_da_tiles(rank, C)
            compile_one(kb._lora_train_da_bwd_kernel,
                        dict(WITH_TERM=True, HAS_DROPOUT=True, MASK_X=True, SPLIT_DS=split_ds, BLOCK_M=bm,
                             BLOCK_K=bk, BLOCK_R=rank), w, 3)
    # base_gemm="tma": TMA copies into wgmma, up to MAX_TMA_RANK.
    for c in kt._configs(C["lora_train_linear_fwd_tma"]["candidates"], kt._FWD_OPERANDS, kt._FWD_EXTRAS):
        for rank in (16, kt.MAX_TMA_RANK):
            compile_one(kt._lora_train_linear_fwd_tma_kernel,
                        dict(c.kwargs, BLOCK_R=rank, MIN_PART=kt.MIN_PART_K_BLOCKS), c.num_warps, c.num_stages,
                        gemm=True, descs={operand[0]: operand for operand in kt._FWD_OPERANDS})
for accumulate in (False, True):
    compile_one(kb._lora_train_slot_reduce_kernel, dict(ACCUMULATE=accumulate, BLOCK=kb.SUM_BLOCK,
                                                        UNROLL=kb.SUM_UNROLL), 2, 1)
compile_one(kb._sum_parts_kernel, dict(BLOCK=kb.SUM_BLOCK, UNROLL=kb.SUM_UNROLL), 2, 1)
print("ok")
"""


def test_kernels_compile_for_hopper_without_spills():
    compile_for_hopper(_COMPILE_SCRIPT)


def test_benchmark_smoke_writes_json_lines(tmp_path):
    # The GPU benchmark's --smoke mode (tiny shapes, interpreter, untimed): every path writes a row
    # and the fused forward matches torch at dropout 0.
    from _benchmark_smoke import smoke_rows

    rows = smoke_rows("benchmarks/kernels/lora_fused_train.py", tmp_path / "bench.jsonl")
    assert sorted(r["path"] for r in rows) == ["base", "base", "engine", "engine", "fused", "fused_blas", "fused_multi",
                                               "fused_multi_blas", "fused_multi_tma", "fused_tma", "kernel1", "kernel1",
                                               "kernel2", "kernel2", "torch_lora", "torch_multi"]
    assert {r["num_adapters"] for r in rows} == {1, 4}
    assert all(r["fused_max_rel_err"] < 1e-5 and r["fused_tma_max_rel_err"] < 1e-5 and r["fwd_ms"] > 0
               and (r["path"] in ("engine", "kernel1", "kernel2") or r["fwd_bwd_ms"] > 0) for r in rows)
    assert all(r["form"] == "blas" for r in rows if r["path"] == "kernel2")  # "auto" on CPU
    assert all(r["x_read_gbps"] > 0 for r in rows if r["path"] == "kernel1")


def test_batch_without_adapter_tokens_is_the_base_linear():
    case = Case(21, 19, 8, (8,), (0.1,), (6, 5), (-1, -1))
    got, want = run_both(case)
    for label, g, w in zip(("y", "dx", "dA", "dB"), got, want):
        assert_close(label, g, w, 1e-4)
    assert bool((got[2] == 0).all()) and bool((got[3] == 0).all())


@pytest.mark.skipif(not INTERPRETED, reason="the GPU tests run the autotuner for real")
def test_autotuned_launches_run_every_config(monkeypatch):
    # The autotuner's plumbing (keys, config kwargs, grid) under the interpreter: every Hopper
    # candidate runs once (the timer is replaced) and the chosen one matches the reference.
    calls = []

    def run_once(kernel_call, quantiles):
        kernel_call()
        calls.append(1)
        return [float(len(calls))] * 3  # the first config "wins"

    for tuner in (fused.linear_term_tuned(DEVICE), fused_bwd.dx_term_tuned(DEVICE)):
        monkeypatch.setattr(tuner, "_do_bench", run_once)
    case = CASES["multi-r16.3.7-p0.1"]
    x, weight, lora_a, lora_b, meta, scalings = make_inputs(case)
    slots = fused.LoRATrainSlots.build(scalings, list(case.dropout_ps), DEVICE)
    token_segs = fused.token_segments(meta)
    s = fused.lora_train_shrink_fwd(x, lora_a, meta, slots, 3)
    dy = torch.randn(x.shape[0], case.out_size, generator=torch.Generator().manual_seed(2))
    ds, _ = fused_bwd.lora_train_ds_db_bwd(dy, lora_b, s, meta, slots)
    y = linear.lora_train_linear_fwd(x, weight, s, lora_b, meta, slots, token_segs, autotune=True)
    dx = linear.lora_train_dx_bwd(dy, weight, ds, lora_a, meta, slots, token_segs, 3, autotune=True)
    assert_close("y", y, linear.lora_train_linear_fwd(x, weight, s, lora_b, meta, slots, token_segs), 1e-5)
    assert_close("dx", dx, linear.lora_train_dx_bwd(dy, weight, ds, lora_a, meta, slots, token_segs, 3), 1e-5)
    configs = train_configs(DEVICE)
    assert len(calls) == (len(configs["lora_train_linear_fwd_term"]["candidates"])
                          + len(configs["lora_train_dx_bwd_term"]["candidates"]))


def test_auto_base_gemm_takes_tma_forward_only_where_it_runs():
    # "auto": kernel 2 timed between its blas and TMA forms on a Hopper GPU (ranks up to
    # MAX_TMA_RANK, 16-byte rows), kernel 4 on cuBLAS; CPU (the interpreter) and wide ranks get
    # "blas" both ways. Other values are the forward's form; the backward's is always "blas".
    from flexserve_kernels.lora.train.fused_tma import MAX_TMA_RANK

    x, weight = torch.zeros(8, 64), torch.zeros(32, 64)
    assert linear.base_gemm_forms("auto", x, weight, 16) == ("blas", "blas")
    for form in fused.BASE_GEMMS:
        assert linear.base_gemm_forms(form, x, weight, 16) == (form, "blas")
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        x, weight = x.cuda().bfloat16(), weight.cuda().bfloat16()
        assert linear.base_gemm_forms("auto", x, weight, MAX_TMA_RANK) == ("auto", "blas")
        assert linear.base_gemm_forms("auto", x, weight, MAX_TMA_RANK + 1) == ("blas", "blas")
        assert linear.base_gemm_forms("auto", x, weight[:31], 16) == ("blas", "blas")  # 62-byte rows of y


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of compute capability >= 9.0")
def test_gpu_auto_forward_form_is_timed_once_per_shape(monkeypatch):
    case = Case(256, 128, 16, (16,), (0.1,), (256,), (0,))
    x, weight, lora_a, lora_b, meta, scalings = make_inputs(case, torch.bfloat16, "cuda")
    slots = fused.LoRATrainSlots.build(scalings, list(case.dropout_ps), "cuda")
    monkeypatch.setattr(linear, "_FORWARD_FORMS", {})
    y = linear.fused_lora_linear(x, weight, lora_a, lora_b, meta, slots, 3)
    (form,) = linear._FORWARD_FORMS.values()
    assert form in ("blas", "tma")
    assert torch.equal(y, linear.fused_lora_linear(x, weight, lora_a, lora_b, meta, slots, 3, base_gemm=form))
    calls = []
    real = linear.lora_train_linear_fwd
    monkeypatch.setattr(linear, "lora_train_linear_fwd", lambda *a, **k: calls.append(k["base_gemm"]) or real(*a, **k))
    linear.fused_lora_linear(x, weight, lora_a, lora_b, meta, slots, 3)
    assert calls == [form]  # looked up, not timed again

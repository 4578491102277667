"""A projection group's LoRA forward as LoRAFusion's kernels (`lora_group_forward`: kernel 1 per
shrink, kernel 2's term written into each column slice, the GEMM adding x W^T as C) against the
torch arithmetic of the same bypass, and which batches take it (`fuses_batch`).

Without CUDA the kernels run on CPU under Triton's interpreter (tests/_triton_interpret.py); with
CUDA the same cases run compiled on the GPU. Tolerances: fp32 operands, sums in another order
than torch's: 1e-5 of the output's largest magnitude.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flexserve_kernels.lora.serve.meta import LoRAKernelMeta

from _triton_interpret import import_kernels, interpreter_hooks, is_interpreted, library_is_compiled

(fused_kernels,) = import_kernels(("flexserve_kernels.lora.train.fused",), interpret=not torch.cuda.is_available())
INTERPRETED = is_interpreted(fused_kernels._lora_train_linear_fwd_kernel)
DEVICE = "cpu" if INTERPRETED else "cuda"
RUN_IN_CHILD = INTERPRETED and library_is_compiled()

test_module_in_interpreter_child_process, _triton_interpret = interpreter_hooks(
    __file__, INTERPRETED, RUN_IN_CHILD)

IN, OUTS, SLOTS, RANK = 48, (32, 16, 16), 3, 8
# rows: (tokens, slot); segment boundaries off every row tile, a row without an adapter between
ROWS = ((80, 0), (70, -1), (90, 1))


def make_group(seed: int = 0):
    """Three LoRALinears of one input (q/k/v-like); k_proj holds no weights in slot 1."""
    from flexserve.layers.lora_linear import LoRALinear

    g = torch.Generator().manual_seed(seed)
    modules = []
    for i, out in enumerate(OUTS):
        base = nn.Linear(IN, out, bias=False)
        base.weight.data = torch.randn(out, IN, generator=g) / IN**0.5
        module = LoRALinear(base, SLOTS, RANK, layer_idx=0, target=("q_proj", "k_proj", "v_proj")[i]).to(DEVICE)
        for slot in range(SLOTS):
            if i == 1 and slot == 1:
                continue
            rank = RANK - 2 * slot  # ranks 8, 6, 4 zero-padded to the slot width
            module.set_slot(slot, torch.randn(rank, IN, generator=g).to(DEVICE) / IN**0.5,
                            torch.randn(out, rank, generator=g).to(DEVICE), scaling=0.5 + slot)
        modules.append(module)
    weight = torch.cat([m.weight for m in modules]).detach()
    x = torch.randn(sum(n for n, _ in ROWS), IN, generator=g).to(DEVICE)
    return tuple(modules), weight, x


def reference(modules, x: torch.Tensor) -> torch.Tensor:
    """x W^T plus scaling * (x A^T) B^T per token of its row's slot, in torch."""
    outs = []
    for m in modules:
        y = x @ m.weight.T
        start = 0
        for n, slot in ROWS:
            if slot >= 0:
                rows = slice(start, start + n)
                y[rows] += m.scaling[slot] * (x[rows] @ m.lora_a[slot].T) @ m.lora_b[slot].T
            start += n
        outs.append(y)
    return torch.cat(outs, dim=1)


def meta_of(rows=ROWS) -> LoRAKernelMeta:
    return LoRAKernelMeta.build([n for n, _ in rows], [s for _, s in rows], DEVICE)


class RecordingCapture:
    """A fine-tuning capture's interface as `lora_group_forward` uses it."""

    def __init__(self, wanted=()):
        self.wanted, self.shrinks, self.fused = set(wanted), {}, []

    def wants(self, layer, name):
        return (layer, name) in self.wanted

    def lora_shrink(self, module, x, meta, fused=False):
        from flexserve_kernels.lora.serve.ops import lora_shrink_fused

        self.fused.append(fused)
        return lora_shrink_fused(x, module.lora_a, meta)

    def take_lora_shrink(self, module, s):
        self.shrinks[module.target] = s.clone()


def test_group_forward_matches_the_bypass_in_torch():
    from flexserve.layers.lora_linear import lora_group_forward

    modules, weight, x = make_group()
    with torch.no_grad():
        y = lora_group_forward(modules, x, weight, meta_of())
        want = reference(modules, x)
    assert y is not None and y.shape == want.shape
    err = (y - want).abs().max() / want.abs().max()
    assert err < 1e-5, err


def test_padded_segments_of_a_graph_bucket_give_the_same_output():
    """A mixed-iteration graph's metadata: one segment per row of the bucket, the unused ones
    empty and starting past every token (so the starts stay sorted), tokens padded to the
    bucket with slot -1; the bucket's real rows come out as with the compact metadata."""
    from flexserve.layers.lora_linear import lora_group_forward

    modules, weight, x = make_group(seed=1)
    meta = meta_of()
    tokens = 256  # bucket: 240 real tokens, 2 segments, padded to 4 rows
    pad = torch.zeros(tokens - x.shape[0], IN, device=DEVICE)
    as_int = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
    bucket = LoRAKernelMeta(
        token_slots=torch.cat([meta.token_slots, as_int([-1] * (tokens - x.shape[0]))]),
        seg_starts=as_int([0, 150, tokens, tokens]), seg_lens=as_int([80, 90, 0, 0]),
        seg_slots=as_int([0, 1, 0, 0]), num_tokens=tokens, max_seg_len=tokens, decode_only=False)
    with torch.no_grad():
        y = lora_group_forward(modules, torch.cat([x, pad]), weight, bucket)
        want = reference(modules, x)
    assert y is not None
    err = (y[:x.shape[0]] - want).abs().max() / want.abs().max()
    assert err < 1e-5, err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphs_replay_what_eager_computes_whatever_the_cached_scratch_holds():
    """Two graphs of the group's forward, at a shape where kernel 1 splits its in-features
    (Llama's hidden size, 256 tokens) and so counts the splits in a scratch buffer: the second
    graph replays first, after every cached scratch buffer is filled with garbage, and still
    gives the eager output (each graph has counters of its own, zeroed by its replay; a cached
    buffer first made inside a capture was never zeroed)."""
    from torch import nn

    from flexserve.layers.lora_linear import LoRALinear, lora_group_forward

    g = torch.Generator().manual_seed(4)
    hidden, rank, tokens = 4096, 16, 256
    modules = []
    for out in (1024, 512):
        base = nn.Linear(hidden, out, bias=False)
        base.weight.data = torch.randn(out, hidden, generator=g) / hidden**0.5
        module = LoRALinear(base, 2, rank).to("cuda", torch.bfloat16)
        for slot in range(2):
            module.set_slot(slot, torch.randn(rank, hidden, generator=g).cuda().bfloat16() / hidden**0.5,
                            torch.randn(out, rank, generator=g).cuda().bfloat16(), scaling=2.0)
        modules.append(module)
    weight = torch.cat([m.weight for m in modules]).detach()
    x = torch.randn(tokens, hidden, generator=g).cuda().bfloat16()
    meta = LoRAKernelMeta.build([100, 156], [0, 1], "cuda")
    with torch.no_grad():
        want = lora_group_forward(modules, x, weight, meta).float()
        fused_kernels._SCRATCH.clear()
        graphs, outputs = [torch.cuda.CUDAGraph() for _ in range(2)], []
        for graph in graphs:
            with torch.cuda.graph(graph):
                outputs.append(lora_group_forward(modules, x, weight, meta))
        for buffer in fused_kernels._SCRATCH.values():
            buffer.fill_(1 << 20)  # no split would ever count to its last
        graphs[1].replay()
        torch.cuda.synchronize()
    err = (outputs[1].float() - want).abs().max() / want.abs().max()
    assert err < 1e-2, err


def test_a_capture_gets_each_shrink_and_a_kept_base_takes_the_sgmv_path():
    from flexserve.layers.lora_linear import lora_group_forward

    modules, weight, x = make_group(seed=2)
    capture = RecordingCapture()
    with torch.no_grad():
        y = lora_group_forward(modules, x, weight, meta_of(), capture)
        want = reference(modules, x)
    assert y is not None and capture.fused == [True, True, True]
    assert set(capture.shrinks) == {"q_proj", "k_proj", "v_proj"}
    s = capture.shrinks["v_proj"]
    assert torch.allclose(s[:80], x[:80] @ modules[2].lora_a[0].T, atol=1e-5)
    assert (s[80:150] == 0).all()  # the row without an adapter
    assert (y - want).abs().max() / want.abs().max() < 1e-5
    # A plan that keeps k_proj's base output needs it apart from the bypass: not this path.
    assert lora_group_forward(modules, x, weight, meta_of(), RecordingCapture({(0, "k_proj_base")})) is None


@pytest.mark.parametrize("rows, rank, fused", [
    (ROWS, RANK, True),
    (((40, 0), (24, 1)), RANK, False),  # 64 tokens: the BGMV size
    (tuple((1, i % SLOTS) for i in range(100)), RANK, False),  # decode rows only
    (tuple((30, i % SLOTS) for i in range(8)), RANK, False),  # 8 segments of 30 tokens: < 64 a segment
    (ROWS, 256, False),  # wider than kernel 1's accumulator
])
def test_which_batches_take_the_fused_kernels(rows, rank, fused):
    from flexserve_kernels.lora.serve.ops import fuses_batch

    meta = meta_of(rows)
    x = torch.empty(meta.num_tokens, IN, device=DEVICE)
    assert fuses_batch(x, meta, rank) is fused


def test_a_group_without_weights_in_the_batch_takes_the_plain_gemm():
    from flexserve.layers.lora_linear import lora_group_forward

    modules, weight, x = make_group(seed=3)
    meta = meta_of(((120, 2), (120, 2)))
    for m in modules:
        m.set_slot(2, None, None)
    meta.slots = frozenset({2})
    assert lora_group_forward(modules, x, weight, meta) is None

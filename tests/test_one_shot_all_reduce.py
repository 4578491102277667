"""The one-shot all-reduce (flexserve/distributed/one_shot_all_reduce.py): which tensors it takes
and how `TensorParallelGroup.all_reduce` routes to it (CPU, a stand-in reducer); on two GPUs its
sums equal NCCL's, eagerly and inside a CUDA graph, and a tensor-parallel engine generates the
same tokens with it as without it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flexserve.distributed import parallel_state
from flexserve.distributed.one_shot_all_reduce import ONE_SHOT_MAX_BYTES, one_shot_eligible
from flexserve.distributed.parallel_state import TensorParallelGroup

two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA GPUs")


@pytest.mark.parametrize("make, eligible", [
    (lambda: torch.zeros(1, 4096, dtype=torch.bfloat16), True),
    (lambda: torch.zeros(256, 8192, dtype=torch.bfloat16), True),  # exactly the cap
    (lambda: torch.zeros(3, 5, dtype=torch.float32), True),
    (lambda: torch.zeros(257, 8192, dtype=torch.bfloat16), False),  # over the cap
    (lambda: torch.zeros(4, 4096, dtype=torch.float16), False),  # not a kernel's dtype
    (lambda: torch.zeros(4, 6, dtype=torch.bfloat16)[:, :3], False),  # not contiguous
    (lambda: torch.zeros(3, dtype=torch.bfloat16), False),  # 6 bytes: no 4-byte access
    (lambda: torch.zeros(0, 4096, dtype=torch.bfloat16), False),
    (lambda: torch.zeros(8, dtype=torch.int64), False),
])
def test_eligible_tensors(make, eligible):
    assert 256 * 8192 * 2 == ONE_SHOT_MAX_BYTES
    assert one_shot_eligible(make()) is eligible


def test_group_routes_small_sums_to_the_one_shot(monkeypatch):
    calls: list[str] = []

    def one_shot(x: torch.Tensor) -> torch.Tensor:
        calls.append("one-shot")
        return x * 2

    def process_group(x, op=None, group=None):
        calls.append(f"process group {op}")

    monkeypatch.setattr(dist, "all_reduce", process_group)
    group = TensorParallelGroup(0, 2, None, one_shot)
    small = torch.ones(2, 8)
    assert torch.equal(group.all_reduce(small), small * 2)  # a new tensor from the reducer
    assert group.all_reduce(small, "max") is small  # in place through the process group
    big = torch.ones(ONE_SHOT_MAX_BYTES // 4 + 1)
    assert group.all_reduce(big) is big
    with group.nccl_only(), group.nccl_only():
        group.all_reduce(small)
    group.all_reduce(small)  # on again once the outer context left
    assert calls == ["one-shot", f"process group {dist.ReduceOp.MAX}",
                     f"process group {dist.ReduceOp.SUM}", f"process group {dist.ReduceOp.SUM}",
                     "one-shot"]
    # One rank reduces nothing, a reducer or not.
    alone = TensorParallelGroup(0, 1, None, one_shot)
    assert alone.all_reduce(small) is small and calls[-1] == "one-shot" and len(calls) == 5


def test_gloo_groups_take_no_one_shot():
    group = parallel_state.init_tensor_parallel(0, 1, "unused", "gloo")
    assert group.one_shot is None
    parallel_state.destroy_tensor_parallel()


def test_cli_option():
    import argparse

    from flexserve.entrypoints.cli.args import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["-tp", "2", "--disable-custom-all-reduce"])
    assert engine_config_from_args(args).parallel.disable_custom_all_reduce
    assert not engine_config_from_args(parser.parse_args(["-tp", "2"])).parallel \
        .disable_custom_all_reduce


# ------------------------------------------------------------------------------- two GPUs
def _compare_on_gpu(rank: int, init_method: str, results) -> None:
    torch.cuda.set_device(rank)
    group = parallel_state.init_tensor_parallel(rank, 2, init_method, "nccl")
    try:
        assert group.one_shot is not None, "two GPUs of one host should reach each other"
        gen = torch.Generator(device="cuda").manual_seed(rank)
        checked = []
        for dtype in (torch.bfloat16, torch.float32):
            for rows in (1, 7, 128):
                x = torch.randn(rows, 4096, generator=gen, device="cuda").to(dtype)
                want = x.clone()
                dist.all_reduce(want)
                got = group.all_reduce(x.clone())
                # Two addends: one rounding either way, so the sums are equal.
                torch.testing.assert_close(got, want, rtol=0, atol=0)
                # Inside a CUDA graph, replayed on new inputs.
                static = x.clone()
                out = group.all_reduce(static)  # warm-up outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = group.all_reduce(static)
                static.copy_(x * 3)
                graph.replay()
                want3 = x * 3
                dist.all_reduce(want3)
                torch.testing.assert_close(out, want3, rtol=0, atol=0)
                checked.append((str(dtype), rows))
        results.put((rank, checked))
    finally:
        parallel_state.destroy_tensor_parallel()


@two_gpus
def test_one_shot_sums_equal_nccl_on_two_gpus():
    from conftest import run_rank_processes

    got = run_rank_processes(_compare_on_gpu, 2, 300)
    assert [rank for rank, _ in got] == [0, 1] and len(got[0][1]) == 6


@two_gpus
def test_tp2_engine_tokens_equal_with_and_without_the_one_shot(tiny_checkpoint):
    """Decode and prefill graphs at 2 ranks (fp32) give the same greedy tokens whichever
    all-reduce they hold."""
    from conftest import make_tiny_config
    from flexserve import LLM, SamplingParams

    path = tiny_checkpoint(make_tiny_config("llama", vocab_size=255), seed=3)
    prompts = [[3, 17, 42, 9, 100, 7, 7, 25, 31, 5, 6], [90, 91, 92], [5] * 40]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = []
    for disable in (False, True):
        llm = LLM(path, tensor_parallel_size=2, dtype="float32", device="cuda",
                  disable_custom_all_reduce=disable, num_blocks=64)
        try:
            tokens.append([o.outputs[0].token_ids
                           for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1]

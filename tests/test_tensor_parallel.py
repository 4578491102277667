"""Tensor parallelism: sharded layers against the unsharded model, the `mp` executor against
one process (greedy tokens, fp32, CPU with gloo), start-up refusals and a dying worker.

The layer tests run every rank of a group in one process, one thread per rank, over a group
whose collectives meet at a barrier: the same shards and sums as torch.distributed, cheaply.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from flexserve.config import EngineConfig, LoRAConfig, ParallelConfig
from flexserve.distributed.parallel_state import (
    TensorParallelGroup,
    destroy_tensor_parallel,
    init_tensor_parallel,
    world_min,
)
from flexserve.engine.lora_request import LoRARequest
from flexserve.entrypoints.llm import LLM
from flexserve.layers.attention import AttentionMetadata
from flexserve.layers.forward_context import set_forward_context
from flexserve.model.llama import LlamaForCausalLM
from flexserve.model.loader import iter_safetensors
from flexserve.model.tp_layout import check_tensor_parallel
from flexserve.sampling_params import SamplingParams
from flexserve.worker.distributed_executor import WorkerDiedError

BLOCK_SIZE = 4
# fp32: the ranks' partial sums add in another order than one GEMM does.
ATOL = 1e-4


class ThreadGroup(TensorParallelGroup):
    """Rank `rank` of a group whose ranks are threads of this process."""

    def __init__(self, rank: int, world_size: int, barrier: threading.Barrier,
                 slots: list) -> None:
        super().__init__(rank, world_size)
        self.barrier, self.slots = barrier, slots

    def _exchange(self, x):
        self.slots[self.rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # everyone has read before the next exchange writes
        return parts

    def all_reduce(self, x):
        parts = self._exchange(x)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return x.copy_(total)

    def all_gather(self, x, dim=-1):
        return torch.cat(self._exchange(x), dim=dim)


def thread_groups(world_size: int) -> list[ThreadGroup]:
    barrier, slots = threading.Barrier(world_size), [None] * world_size
    return [ThreadGroup(r, world_size, barrier, slots) for r in range(world_size)]


def load_rank(path: str, config, tp: TensorParallelGroup) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config, tp=tp)
    model.load_weights(iter_safetensors(path, torch.device("cpu"), model.checkpoint_index))
    return model.eval()


@torch.inference_mode()
def run_steps(model: LlamaForCausalLM, tokens: list[list[int]],
              steps: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every new token of every step ([T, vocab]); step s gives row b steps[s][b]
    new tokens (0: none) of tokens[b], through a paged KV cache."""
    num_blocks = sum(-(-len(t) // BLOCK_SIZE) for t in tokens)
    attn = model.model.layers[0].self_attn.attn
    shape = (2, num_blocks, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
    model.bind_kv_caches([torch.zeros(shape) for _ in range(model.num_layers)])
    tables, first = [], 0
    for t in tokens:
        n = -(-len(t) // BLOCK_SIZE)
        tables.append(list(range(first + n - 1, first - 1, -1)))  # non-contiguous, reversed
        first += n
    done = [0] * len(tokens)
    out = []
    for step in steps:
        rows = [b for b, n in enumerate(step) if n]
        ids = torch.tensor([i for b in rows for i in tokens[b][done[b]:done[b] + step[b]]])
        metadata = AttentionMetadata.build([step[b] for b in rows], [done[b] for b in rows],
                                           [tables[b] for b in rows], BLOCK_SIZE, "cpu")
        with set_forward_context(metadata, None):
            hidden = model(ids, metadata.positions)
        out.append(model.compute_logits(hidden))
        for b in rows:
            done[b] += step[b]
    return out


TOKENS = [[3, 17, 42, 9, 100, 7, 7, 250, 31, 5, 6], [3, 17, 42, 9, 11, 12, 200]]
# Prefill chunks of both rows, then a step of one-token rows.
STEPS = [[5, 3], [4, 3], [1, 1], [1, 0]]

# (config overrides, world size, merged projections): KV heads split and replicated, biases of
# both kinds (the row-parallel ones added by rank 0 only), a vocabulary that does not split
# evenly (padded rows), a tied head, and the merged q/k/v and gate/up GEMMs of the GPU path.
CASES = {
    "llama-kv-split": (dict(model_type="llama", vocab_size=255), 2, False),
    "llama-kv-replicated": (dict(model_type="llama", num_key_value_heads=1), 2, False),
    "llama-biases-4-ranks": (dict(model_type="llama", attention_bias=True, mlp_bias=True,
                                  num_key_value_heads=2, vocab_size=253), 4, False),
    "qwen2-tied": (dict(model_type="qwen2", tie_word_embeddings=True, vocab_size=255), 2, False),
    "qwen2-merged": (dict(model_type="qwen2", num_key_value_heads=1), 2, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_model_matches_unsharded(case, tiny_config, tiny_checkpoint):
    overrides, world_size, merged = CASES[case]
    overrides = dict(overrides)
    config = tiny_config(overrides.pop("model_type"), **overrides)
    path = tiny_checkpoint(config)
    full = run_steps(load_rank(path, config, TensorParallelGroup()), TOKENS, STEPS)
    groups = thread_groups(world_size)
    models = [load_rank(path, config, g) for g in groups]
    if merged:
        for model in models:
            model.merge_projections()
    with ThreadPoolExecutor(world_size) as pool:
        ranks = list(pool.map(lambda m: run_steps(m, TOKENS, STEPS), models))
    for logits in ranks:  # every rank holds the whole logits
        for got, want in zip(logits, full):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # Each rank holds its shard only.
    full_params = sum(p.numel() for p in load_rank(path, config, TensorParallelGroup())
                      .model.layers.parameters())
    rank_params = sum(p.numel() for p in models[0].model.layers.parameters())
    assert rank_params < full_params * 0.75


def test_shards_are_read_from_the_file(tiny_config, tiny_checkpoint):
    config = tiny_config("llama", vocab_size=255)
    path = tiny_checkpoint(config)
    group = thread_groups(2)[1]
    model = LlamaForCausalLM(config, tp=group)
    weights = dict(iter_safetensors(path, torch.device("cpu"), model.checkpoint_index))
    full = dict(iter_safetensors(path, torch.device("cpu")))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(weights[q], full[q][32:64])  # rank 1: heads 2-3 of 4, head_dim 16
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(weights[o], full[o][:, 32:64])
    assert torch.equal(weights["model.embed_tokens.weight"],
                       full["model.embed_tokens.weight"][128:255])  # 127 rows + 1 padding
    model.load_weights(weights.items())
    assert torch.equal(model.model.embed_tokens.weight[127], torch.zeros(64))


@pytest.mark.parametrize("heads,kv_heads,intermediate,world_size,what", [
    (9, 3, 128, 2, "9 attention heads"),
    (4, 2, 128, 3, "4 attention heads"),
    (12, 6, 128, 4, "6 key/value heads"),
    (12, 4, 128, 6, "multiple of the model's 4 key/value heads"),
    (4, 2, 126, 4, "intermediate_size 126"),
])
def test_sizes_that_do_not_split_are_refused(heads, kv_heads, intermediate, world_size, what,
                                              tiny_config):
    config = tiny_config("llama", num_attention_heads=heads, num_key_value_heads=kv_heads,
                         hidden_size=16 * heads, intermediate_size=intermediate)
    with pytest.raises(ValueError, match=what):
        check_tensor_parallel(config, world_size)
    with pytest.raises(ValueError, match=what):
        LlamaForCausalLM(config, tp=TensorParallelGroup(0, world_size))


def test_non_dividing_size_is_refused_at_start_up(smollm2_dir):
    start = time.monotonic()
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        LLM(smollm2_dir, tensor_parallel_size=2, num_blocks=16)
    assert time.monotonic() - start < 20  # refused before any worker started


def test_unsupported_combinations_are_refused():
    assert EngineConfig(lora=LoRAConfig(), parallel=ParallelConfig(tensor_parallel_size=2)).lora
    with pytest.raises(ValueError, match="must be one of"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="threads")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"


def test_cli_options():
    import argparse

    from flexserve.entrypoints.cli.args import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(
        ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]))
    assert config.parallel.tensor_parallel_size == 2
    assert config.parallel.distributed_executor_backend == "mp"
    assert config.lora is None  # off by default under tensor parallelism
    assert engine_config_from_args(parser.parse_args([])).lora is not None
    assert engine_config_from_args(parser.parse_args(["-tp", "2", "--enable-lora"])).lora
    assert engine_config_from_args(parser.parse_args(["-tp", "2", "--max-loras", "3"])).lora
    config = engine_config_from_args(parser.parse_args(["-pp", "2", "-tp", "2"]))
    assert (config.parallel.pipeline_parallel_size, config.parallel.world_size,
            config.parallel.driver_rank) == (2, 4, 2)
    assert config.parallel.distributed_executor_backend == "mp" and config.lora is None
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        ParallelConfig(pipeline_parallel_size=0)


# ------------------------------------------------------------------------ worker processes
def _run_collectives(rank: int, init_method: str, results) -> None:
    group = init_tensor_parallel(rank, 2, init_method, "gloo")
    try:
        summed = group.all_reduce(torch.full((3,), float(rank + 1)))
        # A column slice (a merged projection's first output) is not contiguous.
        wide = torch.full((2, 5), float(rank + 1))
        assert group.all_reduce(wide[:, :3]).tolist() == [[3.0] * 3] * 2
        gathered = group.all_gather(torch.full((2, 1), float(rank)), dim=-1)
        results.put((rank, summed.tolist(), gathered.tolist(), world_min(10 - rank)))
    finally:
        destroy_tensor_parallel()


def test_collectives_over_gloo():
    from conftest import run_rank_processes

    got = run_rank_processes(_run_collectives, 2, 60)
    assert [rank for rank, *_ in got] == [0, 1]
    for _, summed, gathered, smallest in got:
        assert summed == [3.0, 3.0, 3.0]
        assert gathered == [[0.0, 1.0], [0.0, 1.0]]
        assert smallest == 9
    # One rank: no process group, collectives return their input.
    group = init_tensor_parallel(0, 1, "unused", "gloo")
    x = torch.ones(2)
    assert group.all_reduce(x) is x and group.all_gather(x) is x and world_min(4) == 4
    assert not torch.distributed.is_initialized()
    destroy_tensor_parallel()


def greedy_tokens(llm: LLM, prompts, max_tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# Prompts sharing a 12-token prefix (3 full blocks: prefix caching), longer than the token
# budget (chunked prefill).
PROMPTS = [[3, 17, 42, 9, 100, 7, 7, 25, 31, 5, 6, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9],
           [3, 17, 42, 9, 100, 7, 7, 25, 31, 5, 6, 8, 60, 61, 62],
           [90, 91, 92]]
ENGINE = dict(num_blocks=64, block_size=BLOCK_SIZE, max_num_batched_tokens=8,
              enable_prefix_caching=True)


@pytest.fixture(scope="module")
def tiny_tp_checkpoint(tiny_checkpoint):
    from conftest import make_tiny_config

    return tiny_checkpoint(make_tiny_config("llama", vocab_size=255), seed=3)


def sampled_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_tp2_greedy_matches_one_process(tiny_tp_checkpoint):
    one = LLM(tiny_tp_checkpoint, enable_lora=False, **ENGINE)
    want, want_sampled = greedy_tokens(one, PROMPTS), sampled_tokens(one)
    llm = LLM(tiny_tp_checkpoint, tensor_parallel_size=2, distributed_executor_backend="mp",
              **ENGINE)
    try:
        assert llm.engine.info.num_blocks == 64
        assert greedy_tokens(llm, PROMPTS) == want
        # Every rank samples the same tokens (the decode steps after the first feed each rank
        # its own): seeded sampling gives what one process gives.
        assert sampled_tokens(llm) == want_sampled
        # Again: the shared prefix now comes from the cache.
        assert greedy_tokens(llm, PROMPTS[1:2]) == want[1:2]
        with pytest.raises(ValueError, match="on only when asked for"):
            llm.add_lora(LoRARequest("a", 1, "/nonexistent"))
        # A step that raises on the ranks stops them all and names the rank and its error.
        with pytest.raises(WorkerDiedError, match="(?s)rank 0 failed.*AttributeError"):
            llm.engine.executor.execute(object())
        assert all(not p.is_alive() for p in llm.engine.executor.processes)
    finally:
        llm.shutdown()


def test_killed_worker_makes_the_step_raise(tiny_tp_checkpoint):
    """The server's engine: a rank killed between steps ends the engine (unhealthy: 503)
    within a step, and the executor refuses every later step."""
    from flexserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from flexserve.engine.async_engine import EngineDeadError
    from flexserve.entrypoints.engine_builder import build_async_engine

    config = EngineConfig(
        model=ModelConfig(model=tiny_tp_checkpoint),
        cache=CacheConfig(num_blocks=64, block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(max_num_batched_tokens=8),
        parallel=ParallelConfig(tensor_parallel_size=2))
    engine = build_async_engine(config)
    executor = engine.engine.executor
    engine.start()

    async def generate(request_id: str) -> list[int]:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        prepared = engine.prepare(request_id, PROMPTS[0], params)
        async for output in engine.generate(prepared):
            tokens = output.outputs[0].token_ids
        return tokens

    try:
        assert len(asyncio.run(generate("a"))) == 4
        assert engine.is_healthy
        victim = executor.processes[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1"):
            asyncio.run(generate("b"))
        assert time.monotonic() - start < 30
        assert not engine.is_healthy
        assert all(not p.is_alive() for p in executor.processes)
        with pytest.raises(WorkerDiedError, match="rank 1"):
            executor.execute(None)
    finally:
        engine.shutdown()


def test_lora_shards_follow_the_weights():
    from flexserve.model.tp_layout import TensorParallelLayout

    # 4 query heads, 1 key/value head replicated on both ranks, head_dim 2, 6 MLP features.
    a, b = torch.randn(3, 8), torch.randn(8, 3)  # rank 3; q: [8 out, 8 in]
    kv_a, kv_b = torch.randn(3, 8), torch.randn(2, 3)
    mlp_a, mlp_b = torch.randn(3, 6), torch.randn(8, 3)  # down: [8 out, 6 in]
    for rank in (0, 1):
        layout = TensorParallelLayout(rank, 2, 4, 1, 2, 6, 10)
        qa, qb = layout.lora_shard("q_proj", a, b)  # column: B by output rows, A whole
        assert qa is a and torch.equal(qb, b[4 * rank:4 * rank + 4])
        ka, kb = layout.lora_shard("k_proj", kv_a, kv_b)  # the one KV head: whole on each rank
        assert ka is kv_a and torch.equal(kb, kv_b)
        da, db = layout.lora_shard("down_proj", mlp_a, mlp_b)  # row: A by input columns
        assert torch.equal(da, mlp_a[:, 3 * rank:3 * rank + 3]) and db is mlp_b
    # The ranks' partial deltas of a row-parallel projection sum to the whole one.
    x = torch.randn(5, 6)
    parts = [x[:, 3 * r:3 * r + 3] @ TensorParallelLayout(r, 2, 4, 1, 2, 6, 10).lora_shard(
        "down_proj", mlp_a, mlp_b)[0].T @ mlp_b.T for r in (0, 1)]
    torch.testing.assert_close(parts[0] + parts[1], x @ mlp_a.T @ mlp_b.T)


def test_tp2_lora_adapters_match_one_process(tiny_tp_checkpoint, tmp_path):
    """Two adapters (attention and MLP projections, column- and row-parallel) and the base
    model in one batch at TP=2 give one process's greedy tokens; fine-tuning is refused."""

    from _hf_training import save_random_peft_adapter

    g = torch.Generator().manual_seed(11)
    paths = [save_random_peft_adapter(tiny_tp_checkpoint, tmp_path / "a",
                                      ["q_proj", "k_proj", "v_proj", "o_proj"], g, 0.3),
             save_random_peft_adapter(tiny_tp_checkpoint, tmp_path / "b",
                                      ["gate_proj", "up_proj", "down_proj"], g, 0.3)]
    requests = [LoRARequest("a", 1, paths[0]), LoRARequest("b", 2, paths[1]), None]

    def generate(llm):
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, params, lora_request=requests, use_tqdm=False)]

    one = LLM(tiny_tp_checkpoint, max_loras=2, **ENGINE)
    want = generate(one)
    assert want[:2] != greedy_tokens(one, PROMPTS)[:2]  # the adapters change the tokens
    llm = LLM(tiny_tp_checkpoint, tensor_parallel_size=2, max_loras=2, **ENGINE)
    try:
        assert generate(llm) == want
        assert generate(llm) == want  # again, from the slots
        with pytest.raises(ValueError, match="does not exist|not found|No such"):
            llm.engine.add_lora("missing", str(tmp_path / "missing"))
        # A call every rank refuses (bad input) comes back as its ValueError; the ranks stay up.
        with pytest.raises(ValueError, match="no fine-tuning job 'nope'"):
            llm.engine.executor.call_ranks("save_finetune_adapter", "nope", str(tmp_path / "x"))
        with pytest.raises(ValueError, match="not a rank call"):
            llm.engine.executor.call_ranks("execute", None)
        assert generate(llm) == want
    finally:
        llm.shutdown()


def test_tp2_structured_outputs_and_logprobs_match_one_process(tiny_checkpoint):
    """A grammar-constrained row (every rank compiles and masks the same) and logprobs with
    prompt logprobs (from the gathered logits) next to each other, at 2 ranks and in one
    process: the same text, tokens and log-probabilities (fp32 tolerance)."""
    pytest.importorskip("xgrammar")
    from conftest import make_tiny_config
    from flexserve.sampling_params import StructuredOutputsParams

    from _tokenizer import tiny_byte_level_tokenizer

    path = tiny_checkpoint(make_tiny_config("llama", vocab_size=320), seed=4)
    tiny_byte_level_tokenizer().save_pretrained(path)
    params = [SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=(
                  StructuredOutputsParams(choice=["quick brown fox", "lazy dog"]))),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3,
                             prompt_logprobs=2)]

    def run(llm):
        choice, scored = llm.generate(["the quick", "over the lazy"], params, use_tqdm=False)
        out = scored.outputs[0]
        return choice.outputs[0].text, out.token_ids, [
            {t: lp.logprob for t, lp in step.items()} for step in out.logprobs], [
            None if step is None else {t: lp.logprob for t, lp in step.items()}
            for step in scored.prompt_logprobs]

    want = run(LLM(path, enable_lora=False, **ENGINE))
    assert want[0] in ("quick brown fox", "lazy dog")
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        got = run(llm)
    finally:
        llm.shutdown()
    assert got[:2] == want[:2]
    for ours, theirs in zip(got[2] + got[3], want[2] + want[3]):
        if theirs is None:
            assert ours is None
            continue
        assert ours.keys() == theirs.keys()
        for token, logprob in theirs.items():
            assert ours[token] == pytest.approx(logprob, abs=ATOL)


def test_ray_backend_matches_one_process(tiny_tp_checkpoint, monkeypatch):
    """The ranks as actors of a local Ray cluster: one process's tokens; a rank killed
    between steps makes the next step raise, naming it, and stops the other; a cluster without
    room for every rank, or no Ray, is refused at start-up."""
    ray = pytest.importorskip("ray")
    one = LLM(tiny_tp_checkpoint, enable_lora=False, **ENGINE)
    want, want_sampled = greedy_tokens(one, PROMPTS), sampled_tokens(one)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        llm = LLM(tiny_tp_checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray",
                  **ENGINE)
        try:
            assert greedy_tokens(llm, PROMPTS) == want
            assert sampled_tokens(llm) == want_sampled
            ray.kill(llm.engine.executor.actors[1])
            with pytest.raises(WorkerDiedError, match="rank 1"):
                greedy_tokens(llm, PROMPTS[:1])
            with pytest.raises(WorkerDiedError, match="rank 1"):
                llm.engine.executor.execute(None)
        finally:
            llm.shutdown()
        # More ranks than the cluster has room for: refused at start-up, naming its resources.
        import flexserve.worker.ray_executor as ray_executor

        monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 2.0)
        with pytest.raises(ValueError, match="has no room for 4 ranks"):
            LLM(tiny_tp_checkpoint, tensor_parallel_size=4, distributed_executor_backend="ray",
                **ENGINE)
    finally:
        ray.shutdown()
    # Without Ray installed the backend names the extra to install.
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ValueError, match=r"flexserve\[ray\]"):
        LLM(tiny_tp_checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray",
            **ENGINE)


@pytest.mark.slow
def test_tp3_smollm2_greedy_matches_one_process(smollm2_dir, tmp_path):
    """SmolLM2 (9 heads, 3 key/value heads) at 3 ranks, with chunked prefill, prefix caching
    and a LoRA adapter on every projection beside base-model rows: one process's tokens."""
    from _hf_training import save_random_peft_adapter

    prompts = ["The capital of France is", "def fibonacci(n):\n    ",
               "The capital of France is a city that"]
    engine = dict(num_blocks=64, block_size=16, max_num_batched_tokens=16, max_model_len=256,
                  enable_prefix_caching=True)
    adapter = save_random_peft_adapter(
        smollm2_dir, tmp_path / "adapter", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                            "up_proj", "down_proj"],
        torch.Generator().manual_seed(5), 0.05)
    requests = [LoRARequest("a", 1, adapter), None, LoRARequest("a", 1, adapter)]

    def with_adapter(llm):
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(
            prompts, params, lora_request=requests, use_tqdm=False)]

    one = LLM(smollm2_dir, max_loras=1, **engine)
    want, want_lora = greedy_tokens(one, prompts, 12), with_adapter(one)
    assert want_lora[0] != want[0]  # the adapter changes the tokens
    llm = LLM(smollm2_dir, tensor_parallel_size=3, max_loras=1, **engine)
    try:
        assert greedy_tokens(llm, prompts, 12) == want
        assert with_adapter(llm) == want_lora
    finally:
        llm.shutdown()

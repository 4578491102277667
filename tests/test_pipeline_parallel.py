"""Pipeline parallelism (CPU, gloo, fp32): stages holding contiguous parts of the layers, a step's
rows going through them in micro-batches, the last stage sampling; alone and with tensor
parallelism inside each stage, against one process's greedy and seeded tokens."""

from __future__ import annotations

import pytest
import torch

from flexserve.distributed.parallel_state import pipeline_layers
from flexserve.entrypoints.llm import LLM
from flexserve.finetune.hyperparameters import Hyperparameters
from flexserve.sampling_params import SamplingParams
from flexserve.worker.model_runner import _micro_batches

from _training_data import random_training_data

# Prompts sharing a 12-token prefix (3 full blocks: prefix caching), longer than the token
# budget (chunked prefill), and more rows than stages (several micro-batches).
PROMPTS = [[3, 17, 42, 9, 100, 7, 7, 25, 31, 5, 6, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9],
           [3, 17, 42, 9, 100, 7, 7, 25, 31, 5, 6, 8, 60, 61, 62],
           [90, 91, 92], [14, 15], [200, 3, 4, 5, 6]]
ENGINE = dict(num_blocks=64, block_size=4, max_num_batched_tokens=12,
              enable_prefix_caching=True)


def tokens(llm: LLM, temperature: float = 0.0, **kwargs) -> list[list[int]]:
    # Seeded sampling with penalties: the ranks' copies of the output tokens (sent as they
    # grow, `plan_wire`) decide every step's logits.
    penalties = {} if temperature == 0.0 else dict(repetition_penalty=1.3,
                                                  frequency_penalty=0.5, presence_penalty=0.2)
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=7, ignore_eos=True,
                            **penalties)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False,
                                                          **kwargs)]


@pytest.fixture(scope="module")
def tiny_pp_checkpoint(tiny_checkpoint):
    from conftest import make_tiny_config

    # 3 layers over 2 stages (2 + 1), tied embeddings (the last stage's lm_head is read from
    # the embedding's rows), a vocabulary 2 ranks split unevenly.
    return tiny_checkpoint(make_tiny_config("llama", num_hidden_layers=3, vocab_size=255,
                                            tie_word_embeddings=True), seed=5)


def test_stages_split_the_layers_and_micro_batches_split_the_tokens():
    assert [pipeline_layers(30, 4, s) for s in range(4)] == [(0, 8), (8, 16), (16, 23),
                                                             (23, 30)]
    assert [pipeline_layers(3, 3, s) for s in range(3)] == [(0, 1), (1, 2), (2, 3)]
    assert _micro_batches([1] * 8, 2) == [(0, 4), (4, 8)]
    assert _micro_batches([9, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert _micro_batches([5], 4) == [(0, 1)]
    for lengths in ([3, 1, 4, 1, 5, 9, 2, 6], [1, 1], [7, 7, 7]):
        for count in (1, 2, 3, 4):
            groups = _micro_batches(lengths, count)
            assert len(groups) <= count and groups[0][0] == 0 and groups[-1][1] == len(lengths)
            assert all(a < b for a, b in groups)
            assert all(groups[i][1] == groups[i + 1][0] for i in range(len(groups) - 1))


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "pp2-tp2"])
def test_pipeline_matches_one_process(tiny_pp_checkpoint, tp):
    one = LLM(tiny_pp_checkpoint, enable_lora=False, **ENGINE)
    want, want_sampled = tokens(one), tokens(one, temperature=1.0)
    llm = LLM(tiny_pp_checkpoint, pipeline_parallel_size=2, tensor_parallel_size=tp, **ENGINE)
    try:
        assert tokens(llm) == want
        assert tokens(llm, temperature=1.0) == want_sampled
        assert tokens(llm) == want  # again: the shared prefix from the cache
        with pytest.raises(ValueError, match="not run under pipeline parallelism"):
            llm.engine.add_finetune_job(random_training_data([6, 7], seed=1),
                                        Hyperparameters.from_dict({"n_epochs": 1}))
    finally:
        llm.shutdown()


def test_too_many_stages_are_refused(tiny_pp_checkpoint):
    with pytest.raises(ValueError, match="every stage holds at least one"):
        LLM(tiny_pp_checkpoint, pipeline_parallel_size=4, **ENGINE)


def test_pipeline_lora_structured_outputs_and_logprobs_match_one_process(tiny_checkpoint,
                                                                         tmp_path):
    """At 2 stages: two adapters (attention on one stage's layers, MLP on both) beside base
    rows, a grammar-constrained row, and logprobs with prompt logprobs, all from the last
    stage: one process's tokens, text and log-probabilities (fp32 tolerance)."""
    pytest.importorskip("xgrammar")
    from conftest import make_tiny_config
    from flexserve.engine.lora_request import LoRARequest
    from flexserve.sampling_params import StructuredOutputsParams

    from _hf_training import save_random_peft_adapter
    from _tokenizer import tiny_byte_level_tokenizer

    path = tiny_checkpoint(make_tiny_config("llama", vocab_size=320, num_hidden_layers=3),
                           seed=6)
    tiny_byte_level_tokenizer().save_pretrained(path)
    g = torch.Generator().manual_seed(11)
    adapters = [save_random_peft_adapter(path, tmp_path / "a", ["q_proj", "o_proj"], g, 0.3),
                save_random_peft_adapter(path, tmp_path / "b", ["gate_proj", "down_proj"], g,
                                         0.3)]
    requests = [LoRARequest("a", 1, adapters[0]), LoRARequest("b", 2, adapters[1]), None, None]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=(
                  StructuredOutputsParams(choice=["quick brown fox", "lazy dog"]))),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3,
                             prompt_logprobs=2)]
    prompts = ["the quick brown", "jumps over", "the quick", "over the lazy"]

    def run(llm):
        outputs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
        scored = outputs[3]
        return ([o.outputs[0].token_ids for o in outputs[:2]], outputs[2].outputs[0].text,
                scored.outputs[0].token_ids,
                [{t: lp.logprob for t, lp in step.items()} for step in scored.outputs[0].logprobs]
                + [None if step is None else {t: lp.logprob for t, lp in step.items()}
                   for step in scored.prompt_logprobs])

    one = LLM(path, max_loras=2, **ENGINE)
    want = run(one)
    base = [o.outputs[0].token_ids for o in one.generate(prompts[:2], params[:2],
                                                          use_tqdm=False)]
    assert want[0] != base  # the adapters change the tokens
    llm = LLM(path, pipeline_parallel_size=2, max_loras=2, **ENGINE)
    try:
        got = run(llm)
    finally:
        llm.shutdown()
    assert got[:3] == want[:3]
    for ours, theirs in zip(got[3], want[3]):
        if theirs is None:
            assert ours is None
            continue
        assert ours.keys() == theirs.keys()
        for token, logprob in theirs.items():
            assert ours[token] == pytest.approx(logprob, abs=1e-4)


def test_ray_backend_runs_the_stages(tiny_pp_checkpoint):
    ray = pytest.importorskip("ray")
    one = LLM(tiny_pp_checkpoint, enable_lora=False, **ENGINE)
    want = tokens(one)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        llm = LLM(tiny_pp_checkpoint, pipeline_parallel_size=2,
                  distributed_executor_backend="ray", **ENGINE)
        try:
            assert tokens(llm) == want
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_smollm2_at_3_stages_matches_one_process(smollm2_dir):
    """SmolLM2 (30 layers, tied embeddings) over 3 stages of 10 layers: one process's tokens."""
    prompts = ["The capital of France is", "def fibonacci(n):\n    ",
               "The capital of France is a city that", "Once upon a time"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = dict(num_blocks=64, block_size=16, max_num_batched_tokens=16, max_model_len=256,
                  enable_prefix_caching=True, enable_lora=False)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    want = run(LLM(smollm2_dir, **engine))
    llm = LLM(smollm2_dir, pipeline_parallel_size=3, **engine)
    try:
        assert run(llm) == want
    finally:
        llm.shutdown()

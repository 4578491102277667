"""Our decoder over chunked, paged, mixed batches vs HF's full-sequence logits (fp32, CPU).

Each model runs 3 sequences of different lengths through the same schedule: prefill chunks of
several rows in one flat batch (rows in changing order, a later prefill sharing a step with
decode rows), then single-token decode rows, all against a real paged KV cache with shuffled,
non-contiguous block tables. Logits at every position must match HF's `model(input_ids)`.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexserve.config import ModelConfig
from flexserve.layers.attention import AttentionMetadata
from flexserve.layers.forward_context import set_forward_context
from flexserve.model.loader import load_model
from flexserve.model.registry import resolve_model

# fp32 max abs logit difference. Measured (x86 CPU, torch 2.13): <= 2.4e-6 on the tiny models
# (1.5e-5 tied), 6.4e-5 on SmolLM2 whose logits reach ~35; HF's own eager-vs-sdpa and
# full-vs-incremental differences on the same SmolLM2 inputs are also 6.4e-5.
ATOL = 1e-4
BLOCK_SIZE = 3
# (sequence lengths, steps as {sequence: new tokens}); whatever is left after the steps is decoded
# one token per step.
LONG_SCHEDULE = ([20, 14, 26], [{0: 8, 1: 5}, {1: 6, 0: 7, 2: 10}, {2: 9, 0: 1, 1: 1}])
# Fewer steps for the 30-layer real model: every step reads all weights, slow on a small CPU.
SHORT_SCHEDULE = ([12, 9, 15], [{0: 5, 1: 4}, {1: 3, 0: 4, 2: 6}, {2: 7, 0: 1, 1: 1}])


def run_schedule(
    model, sequences: list[torch.Tensor], chunks: list[dict[int, int]], num_kv_heads: int
) -> list[torch.Tensor]:
    """Logits [len, vocab] of every sequence (on CPU), chunk by chunk through the paged cache."""
    gen = torch.Generator().manual_seed(1)
    blocks_needed = [math.ceil(len(s) / BLOCK_SIZE) for s in sequences]
    num_blocks = sum(blocks_needed) + 4
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in blocks_needed]
    param = next(model.parameters())
    device = param.device
    shape = (2, num_blocks, BLOCK_SIZE, num_kv_heads, model.head_dim)
    model.bind_kv_caches(
        [torch.zeros(shape, dtype=param.dtype, device=device) for _ in range(model.num_layers)]
    )

    steps = list(chunks)
    done = [sum(step.get(i, 0) for step in chunks) for i in range(len(sequences))]
    while any(d < len(s) for d, s in zip(done, sequences)):
        steps.append({i: 1 for i, s in enumerate(sequences) if done[i] < len(s)})
        done = [min(d + 1, len(s)) for d, s in zip(done, sequences)]

    computed = [0] * len(sequences)
    logits: list[list[torch.Tensor]] = [[] for _ in sequences]
    for step in steps:
        rows = list(step.items())
        input_ids = torch.cat([sequences[i][computed[i]:computed[i] + n] for i, n in rows])
        metadata = AttentionMetadata.build(
            [n for _, n in rows], [computed[i] for i, _ in rows], [tables[i] for i, _ in rows],
            BLOCK_SIZE, device,
        )
        with torch.inference_mode(), set_forward_context(metadata):
            out = model.compute_logits(model(input_ids.to(device), metadata.positions)).cpu()
        for (i, n), part in zip(rows, out.split([n for _, n in rows])):
            logits[i].append(part)
            computed[i] += n
    model.bind_kv_caches([])
    return [torch.cat(parts) for parts in logits]


def assert_matches_hf(
    path: str, vocab_size: int, schedule=LONG_SCHEDULE, seed: int = 0, device: str = "cpu"
) -> float:
    """Our logits (run on `device`) vs HF's on the CPU; returns the worst abs difference."""
    from transformers import AutoModelForCausalLM

    resolved = resolve_model(path, "auto")
    ours = load_model(ModelConfig(model=path), resolved, torch.device(device), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    seq_lens, chunks = schedule
    sequences = [torch.randint(0, vocab_size, (n,), generator=gen) for n in seq_lens]
    got = run_schedule(ours, sequences, chunks, resolved.hf_config.num_key_value_heads)
    worst = 0.0
    for seq, logits in zip(sequences, got):
        with torch.inference_mode():
            expected = hf(seq[None]).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        worst = max(worst, (logits - expected).abs().max().item())
    return worst


def test_smollm2_real_weights(smollm2_dir):
    assert_matches_hf(smollm2_dir, vocab_size=49152, schedule=SHORT_SCHEDULE)


TINY_CASES = {
    "llama": ("llama", {}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-attention-and-mlp-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    # Positions run past original_max_position_embeddings=8, and head_dim 16's frequencies fall
    # in all three llama3 regimes.
    "llama3-rope-scaling": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}),
    "yarn-rope-scaling": ("qwen2", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "explicit-head-dim": ("llama", {"head_dim": 24}),
}


@pytest.mark.parametrize("case", sorted(TINY_CASES))
def test_tiny_random_models(case, tiny_config, tiny_checkpoint):
    model_type, overrides = TINY_CASES[case]
    path = tiny_checkpoint(tiny_config(model_type, **overrides))
    assert_matches_hf(path, vocab_size=256)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["qwen2-qkv-bias", "llama3-rope-scaling", "llama-tied"])
def test_tiny_random_models_on_cuda(case, tiny_config, tiny_checkpoint):
    model_type, overrides = TINY_CASES[case]
    path = tiny_checkpoint(tiny_config(model_type, **overrides))
    assert_matches_hf(path, vocab_size=256, device="cuda")


def test_sharded_checkpoint(tiny_config, tiny_checkpoint):
    path = tiny_checkpoint(tiny_config("qwen2"), sharded=True)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    assert_matches_hf(path, vocab_size=256)


def _rewrite_weights(path: str, edit) -> None:
    weights = load_file(os.path.join(path, "model.safetensors"))
    edit(weights)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def test_missing_and_unexpected_weights_are_named(tiny_config, tiny_checkpoint):
    path = tiny_checkpoint(tiny_config("llama"))

    def edit(weights):
        weights["model.layers.1.mlp.up_proj.weight_renamed"] = weights.pop(
            "model.layers.1.mlp.up_proj.weight"
        )

    _rewrite_weights(path, edit)
    resolved = resolve_model(path, "auto")
    with pytest.raises(ValueError, match=r"missing 1 \(model\.layers\.1\.mlp\.up_proj\.weight\); "
                                         r"unexpected 1 \(model\.layers\.1\.mlp\.up_proj\.weight_renamed\)"):
        load_model(ModelConfig(model=path), resolved, torch.device("cpu"), torch.float32)


def test_shape_mismatch_is_named(tiny_config, tiny_checkpoint):
    path = tiny_checkpoint(tiny_config("llama"))
    _rewrite_weights(path, lambda w: w.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: checkpoint shape \(65,\)"):
        load_model(ModelConfig(model=path), resolve_model(path), torch.device("cpu"), torch.float32)


def test_rotary_buffers_and_tied_head_in_checkpoint_are_skipped(tiny_config, tiny_checkpoint):
    path = tiny_checkpoint(tiny_config("llama", tie_word_embeddings=True))

    def edit(weights):
        weights["model.rotary_emb.inv_freq"] = torch.ones(8)
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()

    _rewrite_weights(path, edit)
    model = load_model(ModelConfig(model=path), resolve_model(path), torch.device("cpu"), torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_module_names_mirror_hf(tiny_config, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(tiny_config("qwen2"))
    ours = load_model(ModelConfig(model=path), resolve_model(path), torch.device("cpu"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert dict(ours.named_parameters()).keys() == dict(hf.named_parameters()).keys()
    assert not any(p.requires_grad for p in ours.parameters())


def test_kv_cache_binding_is_checked(tiny_config, tiny_checkpoint):
    path = tiny_checkpoint(tiny_config("llama"))
    model = load_model(ModelConfig(model=path), resolve_model(path), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="got 1 KV caches for 2 layers"):
        model.bind_kv_caches([torch.zeros(2, 4, 4, 2, 16)])
    with pytest.raises(ValueError, match=r"expected \[2, num_blocks, block_size, 2, 16\]"):
        model.bind_kv_caches([torch.zeros(2, 4, 4, 4, 16)] * 2)

"""The whole model on the Triton path (paged prefill + decode attention, fused K/V write, RMSNorm,
rotary, SiLU-and-mul) equals the torch path: tiny random Llama and Qwen2 (biases) checkpoints,
fp32, greedy generation with chunked prefill mixed into decode steps.

The kernels run under Triton's interpreter on the CPU, in a child process (TRITON_INTERPRET must
be set before Triton decorates anything); the torch path runs here with FLEXSERVE_KERNELS=torch.
tests/test_gpu_fast_path.py compares the compiled kernels on CUDA.
Tolerance: fp32 with different summation orders (online softmax, fused norms): logprobs within
2e-4 over 2-layer models; tokens must be identical (random unit-variance weights leave no
near-ties at that tolerance).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from _model_outputs import outputs

ATOL = 2e-4


def triton_outputs(model_dir: str, *adapter_dir: str) -> list[dict]:
    # The model runs on the CPU even where CUDA exists: the interpreter is the Triton path here.
    env = dict(os.environ, FLEXSERVE_KERNELS="auto", TRITON_INTERPRET="1")
    here = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run([sys.executable, os.path.join(here, "_model_outputs.py"), model_dir, *adapter_dir],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _random_adapter(config, path) -> str:
    """A rank-2 PEFT adapter on all seven projections with non-zero B."""
    from flexserve.peft.bypass import target_shapes
    from flexserve.peft.lora import LoRAAdapter
    from flexserve.peft.peft_io import save_peft_adapter

    g = torch.Generator().manual_seed(5)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter = LoRAAdapter.create(target_shapes(config), config.num_hidden_layers, rank=2, lora_alpha=4,
                                 target_modules=targets, generator=g)
    for _, b in adapter.weights.values():
        b.normal_(0, 0.5, generator=g)
    save_peft_adapter(adapter, str(path))
    return str(path)


@pytest.mark.parametrize("model_type,lora", [("llama", False), ("qwen2", False), ("llama", True)],
                         ids=["llama", "qwen2", "llama-lora"])
def test_triton_path_equals_torch_path(model_type, lora, tiny_config, tiny_checkpoint, monkeypatch,
                                       tmp_path):
    # Four query heads over one KV head: GQA ratio 4 in the kernels. With LoRA, the Triton path
    # folds the shrinks into the merged GEMMs and fuses the expands (flexserve_kernels.lora.serve.folded).
    config = tiny_config(model_type, num_key_value_heads=1)
    model_dir = tiny_checkpoint(config, seed=3)
    adapter = (_random_adapter(config, tmp_path / "adapter"),) if lora else ()
    monkeypatch.setenv("FLEXSERVE_KERNELS", "torch")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reference = outputs(model_dir, *adapter)
    ours = triton_outputs(model_dir, *adapter)
    for r, o in zip(reference, ours):
        assert o["tokens"] == r["tokens"]
        torch.testing.assert_close(torch.tensor(o["logprobs"]), torch.tensor(r["logprobs"]),
                                   atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(o["prompt_logprobs"]),
                                   torch.tensor(r["prompt_logprobs"]), atol=ATOL, rtol=0)

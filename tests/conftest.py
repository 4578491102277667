"""Shared fixtures: the converted default model, tiny random HF checkpoints, the `gpu` marker."""

from __future__ import annotations

import math

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as an HF directory (converted once into $FLEXSERVE_HOME)."""
    from flexserve.model import default_model

    return default_model.materialize()


_TINY_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)


def make_tiny_config(model_type: str, **overrides):
    """A ~2-layer, hidden-64 transformers config of `model_type` (llama, qwen2 or mistral)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    kwargs = dict(_TINY_BASE)
    if model_type == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    return classes[model_type](**kwargs)


@pytest.fixture(scope="session")
def tiny_config():
    """Factory: tiny_config(model_type, **overrides) -> a tiny transformers config."""
    return make_tiny_config


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF's init (std 0.02, zero biases, unit norms) makes attention nearly uniform and hides bias
    # and norm bugs; unit-variance activations make every part of the layer matter in the logits.
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            param.copy_(0.1 * noise)
        elif "embed_tokens" in name:
            param.copy_(noise)
        else:
            param.copy_(noise / math.sqrt(param.shape[1]))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint(config, sharded=False, seed=0) -> dir with config.json + weights.

    Built with HF's own model class and `save_pretrained`; `sharded` splits the weights into
    several files with a model.safetensors.index.json.
    """
    from transformers import AutoModelForCausalLM

    def make(config, sharded: bool = False, seed: int = 0) -> str:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(model, seed)
        path = tmp_path_factory.mktemp(f"tiny-{config.model_type}")
        model.save_pretrained(path, max_shard_size="100KB" if sharded else "10GB")
        return str(path)

    return make


@pytest.fixture
def fresh_loader():
    """Forget the CUDA BGMV extension's earlier load attempts and logged reasons
    (`flexserve_kernels.lora.serve.cuda_ext`), so a test sees its own."""
    from flexserve_kernels.lora.serve import cuda_ext

    cuda_ext._load.cache_clear()
    cuda_ext._log_once.cache_clear()
    yield
    cuda_ext._load.cache_clear()
    cuda_ext._log_once.cache_clear()


def run_rank_processes(target, world_size: int, timeout: float, *args) -> list:
    """Run `target(rank, init_method, results, *args)` in `world_size` spawned processes (a
    fresh rendezvous port each time) and return what they put on `results`, sorted (each
    result starts with its rank)."""
    import multiprocessing

    from flexserve.distributed.parallel_state import free_port

    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=target, args=(r, init_method, results, *args))
                 for r in range(world_size)]
    for p in processes:
        p.start()
    try:
        return sorted(results.get(timeout=timeout) for _ in processes)
    finally:
        for p in processes:
            p.join(30)
            if p.is_alive():
                p.terminate()

"""Engine configuration: slotted dataclasses that validate themselves on construction.

Every user-facing knob lives here once; the CLI, the offline `LLM` and the tests build these
objects, and a bad value raises `ValueError` naming the field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_MODEL = "smollm2-135m-instruct"
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "dummy")


def flexserve_home() -> str:
    """The state directory for converted models, profiles and jobs (`$FLEXSERVE_HOME`)."""
    return os.path.expanduser(os.environ.get("FLEXSERVE_HOME", "~/.cache/flexserve"))


def _positive(name: str, value: int | float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(slots=True)
class ModelConfig:
    """Which model to load and how."""

    model: str = DEFAULT_MODEL  # a shipped name (see flexserve.model.registry) or an HF directory
    tokenizer: str | None = None  # tokenizer directory; None: the model's own
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    load_format: str = "auto"  # auto: safetensors from the directory; dummy: random weights
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    seed: int = 0  # seed of dummy weights and of unseeded sampling
    device: str = "auto"  # auto: cuda when available, else cpu
    served_model_name: str | None = None  # name the API answers to; None: `model`
    enforce_eager: bool = False  # CUDA: never replay CUDA graphs (decode runs eagerly)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty name or path")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        _positive("max_model_len", self.max_model_len, allow_none=True)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache geometry and sizing."""

    block_size: int = 16  # tokens per KV block
    gpu_memory_utilization: float = 0.90  # CUDA: fraction of device memory flexserve may use
    kv_cache_gib: float = 1.0  # CPU: KV cache size in GiB
    num_blocks: int | None = None  # overrides the sizing above (tests use it to force preemption)
    enable_prefix_caching: bool = True  # reuse full blocks with equal token prefixes

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        _positive("kv_cache_gib", self.kv_cache_gib)
        _positive("num_blocks", self.num_blocks, allow_none=True)


@dataclass(slots=True)
class SchedulerConfig:
    """Per-iteration limits of the scheduler."""

    max_num_batched_tokens: int = 2048  # token budget of one iteration (prefill chunks + decodes)
    max_num_seqs: int = 256  # running requests at most

    def __post_init__(self) -> None:
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)


def _positive_int(name: str, value: object) -> None:
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(slots=True)
class LoRAConfig:
    """Multi-LoRA serving: device slots, the host-memory cache, limits, adapters loaded at start."""

    max_loras: int = 4  # adapters resident in device slots = distinct adapters in one batch
    max_cpu_loras: int | None = None  # adapters held in host memory (LRU); None: max(max_loras, 8)
    max_lora_rank: int = 64  # width of every slot; adapters of a larger rank are refused
    allowed_adapter_dir: str | None = None  # adapter paths must resolve inside it; None: anywhere
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> PEFT dir, loaded at start

    def __post_init__(self) -> None:
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = max(self.max_loras, 8)
        _positive_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                "the host cache feeds the device slots"
            )
        if self.allowed_adapter_dir is not None:
            if not isinstance(self.allowed_adapter_dir, str) or not self.allowed_adapter_dir:
                raise ValueError("allowed_adapter_dir must be a directory path")
            # Resolved once here, so the check of each adapter path compares real paths.
            resolved = os.path.realpath(os.path.expanduser(self.allowed_adapter_dir))
            if not os.path.isdir(resolved):
                raise ValueError(
                    f"allowed_adapter_dir {self.allowed_adapter_dir!r} is not a directory")
            self.allowed_adapter_dir = resolved
        if not isinstance(self.lora_modules, dict):
            raise ValueError("lora_modules must be a dict of adapter name -> path")
        for name, path in self.lora_modules.items():
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"lora_modules: adapter names must be non-empty, got {name!r}")
            if not isinstance(path, str) or not path:
                raise ValueError(f"lora_modules: adapter {name!r} needs a path, got {path!r}")


@dataclass(slots=True)
class FinetuneConfig:
    """Token-level fine-tuning in the serving engine (needs LoRA slots: a job holds one)."""

    max_finetune_len: int | None = None  # longest training sequence; None: max_model_len
    remat_threshold: float | None = None  # graph pruning's recompute threshold; None: its default
    loss_chunk_rows: int = 1024  # rows whose full-vocabulary logits exist at once in the loss

    def __post_init__(self) -> None:
        _positive("max_finetune_len", self.max_finetune_len, allow_none=True)
        _positive_int("loss_chunk_rows", self.loss_chunk_rows)
        if self.remat_threshold is not None and (
                isinstance(self.remat_threshold, bool) or self.remat_threshold < 0):
            raise ValueError(f"remat_threshold must be >= 0, got {self.remat_threshold!r}")


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine needs; `max_model_len` is resolved from the checkpoint when loaded."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig | None = None  # None: LoRA disabled (no slots, no wrapped linears)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    disable_log_stats: bool = False  # periodic one-line stats in the log

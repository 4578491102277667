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
    # Schedule and launch a decode step before the previous one's tokens reach the host, so the
    # host's per-step work overlaps the device's (`Scheduler.schedule_continuation`).
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")


def _positive_int(name: str, value: object) -> None:
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(slots=True)
class LoRAConfig:
    """Multi-LoRA serving: device slots, the host-memory cache, limits, adapters loaded at start."""

    max_loras: int = 4  # adapters resident in device slots = distinct adapters in one batch
    max_cpu_loras: int | None = None  # adapters held in host memory (LRU); None: max(max_loras, 8)
    max_lora_rank: int = 64  # width of every slot; adapters of a larger rank are refused
    # fine-tuning jobs' adapter slots, after the max_loras serving slots (a running job holds
    # one); None: sized from FinetuneConfig.job_memory_gib at start-up
    max_finetune_loras: int | None = None
    allowed_adapter_dir: str | None = None  # adapter paths must resolve inside it; None: anywhere
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> PEFT dir, loaded at start
    # Roots of adapters the server writes itself (the fine-tuning service's checkpoints, added
    # by it): servable even when allowed_adapter_dir points elsewhere.
    internal_adapter_dirs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_finetune_loras is not None:
            _positive_int("max_finetune_loras", self.max_finetune_loras)
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

    def allowed_dir_for(self, path: str) -> str | None:
        """The directory `path` must resolve inside: None (anywhere) inside one of the
        internal_adapter_dirs, else allowed_adapter_dir (symlinks and `..` resolved first)."""
        real = os.path.realpath(os.path.expanduser(path))
        for root in self.internal_adapter_dirs:
            root = os.path.realpath(root)
            if os.path.commonpath([real, root]) == root:
                return None
        return self.allowed_adapter_dir


@dataclass(slots=True)
class FinetuneConfig:
    """Token-level fine-tuning in the serving engine (needs LoRA slots: a job holds one)."""

    max_finetune_len: int | None = None  # longest training sequence; None: max_model_len
    remat_threshold: float | None = None  # graph pruning's recompute threshold; None: its default
    remat_chains: bool = False  # also recompute through tensors the backward does not read
    warmup: bool = True  # compile the fine-tuning kernels at start-up (CUDA, LoRA on)
    loss_chunk_rows: int = 1024  # rows whose full-vocabulary logits exist at once in the loss
    # GiB one sequence's activation store may take (at the job's longest sequence); layers go
    # to remat chains, lowest first, until it fits (`flexserve.peft.activation_budget`); None: off
    activation_budget_gib: float | None = None
    # under a budget, put every other layer in pinned host memory before any goes to remat
    # chains (`flexserve.worker.finetune.activation_offload`)
    activation_offload: bool = False
    # time limit of the MILP packing of a round of the running jobs' sequences into bins, all
    # stages together (`flexserve.finetune.packing`; it runs on the engine thread); 0: greedy only
    packing_time_limit_s: float = 0.05
    max_length_buckets: int = 4  # LobRA's length buckets of a round's sequences (1: none)
    # Backward windows of several jobs of one plan as one (docs/finetuning.md, "Backward windows
    # of several jobs together"); off: each job's windows run on their own
    batched_backward: bool = False
    # GiB for fine-tuning jobs: their LoRA slots and training state (fp32 adapter weights,
    # gradients, AdamW moments); a job waits queued while its state does not fit what running
    # jobs leave; None: 5% of the device's memory (host memory on the CPU)
    job_memory_gib: float | None = None

    def __post_init__(self) -> None:
        _positive("max_finetune_len", self.max_finetune_len, allow_none=True)
        if (isinstance(self.packing_time_limit_s, bool)
                or not isinstance(self.packing_time_limit_s, (int, float))
                or not 0 <= self.packing_time_limit_s <= 60):
            raise ValueError(f"packing_time_limit_s must be in [0, 60] seconds, got "
                             f"{self.packing_time_limit_s!r}")
        _positive_int("max_length_buckets", self.max_length_buckets)
        _positive("job_memory_gib", self.job_memory_gib, allow_none=True)
        _positive_int("loss_chunk_rows", self.loss_chunk_rows)
        _positive("activation_budget_gib", self.activation_budget_gib, allow_none=True)
        if self.activation_budget_gib is not None and not self.activation_budget_gib < float("inf"):
            raise ValueError(f"activation_budget_gib must be finite, got "
                             f"{self.activation_budget_gib!r}")
        if self.remat_threshold is not None and (
                isinstance(self.remat_threshold, bool) or self.remat_threshold < 0):
            raise ValueError(f"remat_threshold must be >= 0, got {self.remat_threshold!r}")


_POLICIES = ("coserve", "temporal", "dynamic-temporal", "spatial", "inference-only")
_TPOT_MODES = ("iteration", "mean")


@dataclass(slots=True)
class CoserveConfig:
    """How inference and fine-tuning share iterations (FlexLLM 6.2, appendices A and C)."""

    policy: str = "coserve"  # coserve | temporal | dynamic-temporal | spatial | inference-only
    slo_tpot_ms: float | None = 50.0  # time-per-output-token SLO: the iteration time the
    # windows fit in; None: no SLO, fine-tuning windows fill the token budget (offline use)
    slo_ttft_ms: float = 5000.0  # time-to-first-token SLO (attainment, and TTFT pressure)
    slo_tpot_mode: str = "iteration"  # iteration: every iteration within the TPOT limit
    # (FlexLLM 6.2); mean: the mean of the last iterations with running requests within it
    slo_margin: float = 0.2  # fraction of the TPOT SLO kept free for latency-model error and
    # for the occasional backward iteration 2-3x slower than its shape predicts (measured on an
    # H200, docs/benchmarks.md)
    finetune_min_share: float = 0.0  # fraction of the token budget fine-tuning keeps beside
    # running requests when they alone are predicted over the TPOT limit, or when a prompt nears
    # its TTFT deadline; 0: none, inference keeps priority (with no request running,
    # fine-tuning always runs)
    ttft_pressure: float = 0.5  # a prompt waiting longer than this fraction of the TTFT SLO
    # shrinks fine-tuning to its minimum share
    temporal_frequency: int = 64  # temporal: one fine-tuning step after every n iterations
    latency_profile: str | None = None  # a `flexserve profile` JSON; None: the state dir's match
    vtc_prompt_weight: float = 1.0  # w_p of the Virtual Token Counter (per prompt token)
    vtc_output_weight: float = 2.0  # w_q (per generated token)
    vtc_finetune_weight: float = 1.0  # w_r (per fine-tuning token, forward plus backward)
    finetune_backward_stream: bool = False  # CUDA: run backward windows on a second stream,
    # concurrently with the forward (FlexLLM figure 9)

    def __post_init__(self) -> None:
        if self.policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {self.policy!r}")
        _positive("slo_tpot_ms", self.slo_tpot_ms, allow_none=True)
        _positive("slo_ttft_ms", self.slo_ttft_ms)
        if self.slo_tpot_mode not in _TPOT_MODES:
            raise ValueError(f"slo_tpot_mode must be one of {_TPOT_MODES}, got "
                             f"{self.slo_tpot_mode!r}")
        for name in ("slo_margin", "finetune_min_share", "ttft_pressure"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        _positive_int("temporal_frequency", self.temporal_frequency)
        for name in ("vtc_prompt_weight", "vtc_output_weight", "vtc_finetune_weight"):
            _positive(name, getattr(self, name))
        if self.latency_profile is not None and not os.path.isfile(self.latency_profile):
            raise ValueError(f"latency_profile {self.latency_profile!r} is not a file")


_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(slots=True)
class ParallelConfig:
    """How many devices serve the model and what drives them."""

    tensor_parallel_size: int = 1  # ranks each holding a shard of every layer (Megatron-LM)
    # stages each holding a contiguous part of the layers (tensor_parallel_size ranks each)
    pipeline_parallel_size: int = 1
    # mp: one worker process per rank on this host; ray: one Ray actor per rank on a Ray
    # cluster (several hosts); None: mp when there is more than one rank
    distributed_executor_backend: str | None = None
    # CUDA, ranks on one host: small sums (a decode step's all-reduces) by the one-shot
    # all-reduce over the GPUs' peer links instead of NCCL (distributed/one_shot_all_reduce.py)
    disable_custom_all_reduce: bool = False

    def __post_init__(self) -> None:
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        backend = self.distributed_executor_backend
        if backend is not None and backend not in _EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{_EXECUTOR_BACKENDS}, got {backend!r}")
        if backend is None and self.world_size > 1:
            self.distributed_executor_backend = "mp"

    @property
    def world_size(self) -> int:
        """Processes (one device each): every stage's tensor-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def driver_rank(self) -> int:
        """The rank whose step results the engine takes: the last stage's first (it samples)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine needs; `max_model_len` is resolved from the checkpoint when loaded."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig | None = None  # None: LoRA off (no slots, no wrapped linears); the CLI
    # and `LLM` give a LoRAConfig unless told --no-enable-lora / enable_lora=False
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    coserve: CoserveConfig = field(default_factory=CoserveConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    disable_log_stats: bool = False  # periodic one-line stats in the log


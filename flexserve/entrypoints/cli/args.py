"""The engine options every subcommand that builds an engine shares (serve, bench, profile)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from flexserve import envs
from flexserve.config import (
    DEFAULT_MODEL,
    CacheConfig,
    CoserveConfig,
    EngineConfig,
    FinetuneConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, cache, scheduler and LoRA options (serve, bench); defaults from the configs."""
    model, cache, scheduler = ModelConfig(), CacheConfig(), SchedulerConfig()
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help="a shipped model name or a Hugging Face directory [%(default)s]")
    group.add_argument("--tokenizer", default=None, help="tokenizer directory [the model's]")
    group.add_argument("--dtype", default=model.dtype,
                       choices=("auto", "float32", "bfloat16", "float16"),
                       help="auto: float32 on CPU, bfloat16 on CUDA [%(default)s]")
    group.add_argument("--load-format", default=model.load_format, choices=("auto", "dummy"),
                       help="dummy: random weights, for benchmarks [%(default)s]")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length [the checkpoint's max_position_embeddings]")
    group.add_argument("--device", default=model.device, help="auto, cpu, cuda or cuda:N")
    group.add_argument("--seed", type=int, default=model.seed,
                       help="seed of dummy weights and of unseeded sampling [%(default)s]")
    group.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: run decode eagerly instead of replaying CUDA graphs")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="ranks each holding a shard of every layer (Megatron-style tensor "
                            "parallelism); LoRA is off above 1 unless asked for [%(default)s]")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                       help="pipeline stages each holding a contiguous part of the layers, on "
                            "--tensor-parallel-size ranks each; steps go through them in "
                            "micro-batches; no fine-tuning [%(default)s]")
    group.add_argument("--distributed-executor-backend", default=None, choices=("mp", "ray"),
                       help="what drives the ranks: mp, one worker process per rank on this "
                            "host; ray, one Ray actor per rank on the Ray cluster (RAY_ADDRESS "
                            "or `ray start` on this host; several hosts) [mp when there is "
                            "more than one rank]")
    group.add_argument("--disable-custom-all-reduce", action="store_true",
                       help="CUDA: every all-reduce through NCCL, none through the one-shot "
                            "all-reduce over the GPUs' peer links (used for small sums when all "
                            "ranks are on one host)")
    group.add_argument("--state-dir", default=None,
                       help="converted models, profiles and jobs [$FLEXSERVE_HOME or "
                            "~/.cache/flexserve]")

    group = parser.add_argument_group("KV cache and scheduler")
    group.add_argument("--block-size", type=int, default=cache.block_size,
                       help="tokens per KV block [%(default)s]")
    group.add_argument("--gpu-memory-utilization", type=float,
                       default=cache.gpu_memory_utilization,
                       help="CUDA: fraction of device memory to use [%(default)s]")
    group.add_argument("--kv-cache-gib", type=float, default=cache.kv_cache_gib,
                       help="CPU: KV cache size in GiB [%(default)s]")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=cache.enable_prefix_caching,
                       help="reuse KV blocks of equal prompt prefixes [on]")
    group.add_argument("--max-num-batched-tokens", type=int,
                       default=scheduler.max_num_batched_tokens,
                       help="token budget of one iteration [%(default)s]")
    group.add_argument("--max-num-seqs", type=int, default=scheduler.max_num_seqs,
                       help="running requests at most [%(default)s]")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                       default=scheduler.async_scheduling,
                       help="launch the next decode step before the previous one's tokens reach "
                            "the host, so host work overlaps the device's [on]")

    coserve = CoserveConfig()
    group = parser.add_argument_group("co-serving (how fine-tuning shares iterations)")
    group.add_argument("--coserve-policy", default=coserve.policy,
                       choices=("coserve", "temporal", "dynamic-temporal", "spatial",
                                "inference-only"),
                       help="coserve: SLO-sized fine-tuning windows in every iteration; temporal: "
                            "a fine-tuning step after every --temporal-frequency iterations; "
                            "dynamic-temporal: FlexLLM's adaptive interval; spatial: fine-tuning "
                            "on its own CUDA stream; inference-only [%(default)s]")
    group.add_argument("--slo-tpot-ms", type=float, default=coserve.slo_tpot_ms,
                       help="time-per-output-token SLO; fine-tuning windows fit in it "
                            "[%(default)s]")
    group.add_argument("--slo-ttft-ms", type=float, default=coserve.slo_ttft_ms,
                       help="time-to-first-token SLO [%(default)s]")
    group.add_argument("--slo-tpot-mode", default=coserve.slo_tpot_mode,
                       choices=("iteration", "mean"),
                       help="iteration: every co-served iteration fits the TPOT limit (FlexLLM); "
                            "mean: the mean of the last 32 iterations with running requests "
                            "does, so short decode iterations leave room for longer fine-tuning "
                            "ones (at most 3x the SLO each) [%(default)s]")
    group.add_argument("--slo-margin", type=float, default=coserve.slo_margin,
                       help="fraction of the TPOT SLO kept free for prediction error "
                            "[%(default)s]")
    group.add_argument("--finetune-min-share", type=float, default=coserve.finetune_min_share,
                       help="fraction of the token budget fine-tuning keeps when inference "
                            "saturates the SLO [%(default)s]")
    group.add_argument("--temporal-frequency", type=int, default=coserve.temporal_frequency,
                       help="temporal policy: inference iterations between fine-tuning steps "
                            "[%(default)s]")
    group.add_argument("--latency-profile", default=None,
                       help="a `flexserve profile` JSON [the state dir's profile of this device, "
                            "model and dtype, else a conservative online fallback]")
    group.add_argument("--finetune-backward-stream", action="store_true",
                       help="CUDA: run fine-tuning backward windows on a second stream, "
                            "concurrently with the forward")

    lora = LoRAConfig()
    finetune = FinetuneConfig()
    group = parser.add_argument_group(
        "fine-tuning (token-level LoRA jobs; each holds a fine-tuning LoRA slot)")
    group.add_argument("--max-finetune-len", type=int, default=None,
                       help="longest training sequence; sizes each sequence's gradient buffers "
                            "[max_model_len]")
    group.add_argument("--remat-threshold", type=float, default=None,
                       help="graph pruning: recompute kept tensors whose op costs less than this "
                            "fraction of a layer's forward FLOPs [0.01]")
    group.add_argument("--no-finetune-warmup", action="store_true",
                       help="skip compiling the fine-tuning kernels at start-up (CUDA): the first "
                            "job then compiles them while requests may be waiting")
    group.add_argument("--remat-chains", action="store_true",
                       help="graph pruning beyond algorithm 1: also recompute through tensors the "
                            "backward does not read (e.g. the MLP's gate/up from x_mid), within "
                            "--remat-threshold: less activation memory, more backward time")
    group.add_argument("--finetune-activation-budget", type=float, default=None, metavar="GIB",
                       help="GiB one fine-tuning sequence's activation store may take (sized "
                            "for the job's longest sequence): the lowest layers switch to remat "
                            "chains (at --remat-threshold, else 0.6) until it fits; a job that "
                            "cannot fit fails [off]")
    group.add_argument("--finetune-activation-offload", action="store_true",
                       help="under --finetune-activation-budget, keep every other layer's "
                            "activations in pinned host memory (copied on a side stream while "
                            "the GPU computes) before any layer recomputes [off]")
    group.add_argument("--finetune-job-memory-gib", type=float, default=None, metavar="GIB",
                       help="memory for fine-tuning jobs' LoRA slots and training state (fp32 "
                            "adapter weights, gradients, AdamW moments), kept out of the KV "
                            "cache; a job waits queued while its state does not fit [5%% of the "
                            "device's memory]")
    group.add_argument("--max-finetune-loras", type=int, default=None,
                       help="LoRA slots for fine-tuning jobs, beside the --max-loras serving "
                            "slots (one per running job) [half the job memory's worth, at most "
                            "32]")
    group.add_argument("--finetune-batched-backward", action="store_true",
                       help="run the backward windows of up to 8 jobs of one plan (LoRA rank, "
                            "targets, no dropout) as one: the frozen GEMMs once over every job's "
                            "rows (CUDA graphs; measured slower than each job's own windows on "
                            "an H200, docs/benchmarks.md) [off]")
    group.add_argument("--finetune-packing-time-limit", type=float,
                       default=finetune.packing_time_limit_s, metavar="S",
                       help="time limit of the MILP packing of the running jobs' sequences into "
                            "bins, per round, on the engine thread (needs scipy); 0: greedy "
                            "packing [%(default)s]")
    group.add_argument("--finetune-length-buckets", type=int,
                       default=finetune.max_length_buckets,
                       help="length buckets the sequences of a packing round are grouped in "
                            "(LobRA's dynamic bucketing) [%(default)s]")
    group = parser.add_argument_group(
        "LoRA slots (on by default: fine-tuning jobs and served adapters use them)")
    group.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=None,
                       help="LoRA slots for fine-tuning jobs and adapters loaded at start-up or "
                            "at run time; a batch without adapters runs only the base GEMMs. "
                            "--no-enable-lora: no slots, no fine-tuning, no adapters [on, off "
                            "with --tensor-parallel-size > 1]")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="adapters to load at start-up, as name=path or as JSON "
                            '\'{"name": "...", "path": "..."}\'')
    group.add_argument("--max-loras", type=int, default=None,
                       help=f"adapters in device slots = distinct adapters per batch "
                            f"[{lora.max_loras}]")
    group.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept read in host memory, LRU [max(max_loras, 8)]")
    group.add_argument("--max-lora-rank", type=int, default=None,
                       help=f"largest adapter rank (the width of every slot) "
                            f"[{lora.max_lora_rank}]")
    group.add_argument("--allowed-adapter-dir", default=None,
                       help="adapter paths must resolve inside this directory [anywhere]")


def parse_lora_modules(values: Sequence[str] | None) -> dict[str, str]:
    """`name=path` or vLLM's JSON `{"name": ..., "path": ...}` items -> {name: path}."""
    modules: dict[str, str] = {}
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: invalid JSON {value!r}: {e}") from e
            name, path = item.get("name"), item.get("path")
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules: expected NAME=PATH, got {value!r}")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules: {value!r} needs a non-empty name and path")
        if name in modules:
            raise ValueError(f"--lora-modules: adapter name {name!r} is given twice")
        modules[name] = path
    return modules


def lora_config_from_args(args: argparse.Namespace) -> LoRAConfig | None:
    """LoRAConfig (the default), or None under --no-enable-lora (and by default with
    --tensor-parallel-size > 1 and no LoRA option); ValueError when --no-enable-lora is
    combined with a LoRA option."""
    given = {
        "max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras,
        "max_lora_rank": args.max_lora_rank, "allowed_adapter_dir": args.allowed_adapter_dir,
        "max_finetune_loras": args.max_finetune_loras,
    }
    given = {k: v for k, v in given.items() if v is not None}
    modules = parse_lora_modules(args.lora_modules)
    enable = args.enable_lora
    if enable is None:
        ranks = ParallelConfig(tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                               pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1))
        enable = ranks.world_size == 1 or bool(given or modules)
    if not enable:
        options = [f"--{k.replace('_', '-')}" for k in given] + (["--lora-modules"] if modules
                                                                  else [])
        if options:
            raise ValueError(f"--no-enable-lora turns LoRA off, so {', '.join(options)} "
                             "cannot apply: drop one or the other")
        return None
    return LoRAConfig(lora_modules=modules, **given)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Raises ValueError naming the bad option."""
    return EngineConfig(
        model=ModelConfig(
            model=args.model, tokenizer=args.tokenizer, dtype=args.dtype,
            load_format=args.load_format, max_model_len=args.max_model_len, seed=args.seed,
            device=args.device, served_model_name=getattr(args, "served_model_name", None),
            enforce_eager=args.enforce_eager,
        ),
        cache=CacheConfig(
            block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_gib=args.kv_cache_gib, enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            async_scheduling=args.async_scheduling,
        ),
        lora=lora_config_from_args(args),
        finetune=FinetuneConfig(max_finetune_len=args.max_finetune_len,
                                remat_threshold=args.remat_threshold,
                                remat_chains=args.remat_chains,
                                warmup=not args.no_finetune_warmup,
                                activation_budget_gib=args.finetune_activation_budget,
                                activation_offload=args.finetune_activation_offload,
                                job_memory_gib=args.finetune_job_memory_gib,
                                packing_time_limit_s=args.finetune_packing_time_limit,
                                max_length_buckets=args.finetune_length_buckets,
                                batched_backward=args.finetune_batched_backward),
        coserve=CoserveConfig(
            policy=args.coserve_policy, slo_tpot_ms=args.slo_tpot_ms,
            slo_ttft_ms=args.slo_ttft_ms, slo_margin=args.slo_margin,
            slo_tpot_mode=args.slo_tpot_mode,
            finetune_min_share=args.finetune_min_share,
            temporal_frequency=args.temporal_frequency, latency_profile=args.latency_profile,
            finetune_backward_stream=args.finetune_backward_stream),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
            distributed_executor_backend=args.distributed_executor_backend,
            disable_custom_all_reduce=getattr(args, "disable_custom_all_reduce", False)),
        disable_log_stats=getattr(args, "disable_log_stats", False),
    )


def apply_state_dir(args: argparse.Namespace) -> None:
    """--state-dir: the model registry and the converters read it from the environment."""
    if args.state_dir:
        envs.set_home(args.state_dir)

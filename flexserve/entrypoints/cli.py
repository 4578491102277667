"""The `flexserve` command: `flexserve serve` runs the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from flexserve.config import (
    DEFAULT_MODEL,
    CacheConfig,
    CoserveConfig,
    EngineConfig,
    FinetuneConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
)

logger = logging.getLogger("flexserve.serve")

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


class _RepeatedKey(argparse.Action):
    """`--api-key` may repeat: every value lands in `api_keys`, and `api_key` keeps the last."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        namespace.api_keys = [*(getattr(namespace, "api_keys", None) or []), values]
        namespace.api_key = values


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `flexserve serve`: the server's, then the engine's."""
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind (0.0.0.0: all interfaces) [%(default)s]")
    server.add_argument("--port", type=int, default=8000, help="port [%(default)s]")
    server.add_argument("--api-key", action=_RepeatedKey, default=None,
                        help="require `Authorization: Bearer KEY` on /v1/*; repeat for several "
                             "keys [$FLEXSERVE_API_KEY, else none]")
    parser.set_defaults(api_keys=None)
    # --- reliability and security (docs/operations.md) ---
    server.add_argument("--api-key-file", default=None,
                        help="API keys, one a line: `key` or `tenant:key` (the tenant is the "
                             "key's account for fairness, limits and jobs)")
    server.add_argument("--max-queue-len", type=int, default=1024,
                        help="generation requests waiting beyond --max-num-seqs running; past "
                             "it new ones get 429 with Retry-After [%(default)s]")
    server.add_argument("--max-requests-per-tenant", type=int, default=None,
                        help="generation requests one tenant may have in flight; past it 429 "
                             "[unlimited]")
    server.add_argument("--request-timeout-s", type=float, default=None,
                        help="abort a request still running this long after it arrived (408, "
                             "KV freed) [no limit]")
    server.add_argument("--shutdown-grace-s", type=float, default=30.0,
                        help="on SIGTERM: time for requests in flight to finish (new ones get "
                             "503) and for running jobs to checkpoint [%(default)s]")
    server.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                        help="enable CORS for these browser origins (`*`: any) [CORS off]")
    # --- end reliability and security ---
    server.add_argument("--served-model-name", default=None,
                        help="the model name clients use [the --model value]")
    server.add_argument("--max-request-body-bytes", type=int, default=10 * 1024 * 1024,
                        help="larger request bodies get 413 [%(default)s]")
    server.add_argument("--log-level", choices=_LOG_LEVELS, default="info",
                        help="log level of flexserve and uvicorn [%(default)s]")
    server.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic one-line engine stats in the log")
    # Fine-tuning over HTTP (files and jobs live under --state-dir).
    server.add_argument("--max-upload-mb", type=int, default=100,
                        help="largest training file POST /v1/files accepts, in MiB "
                             "[%(default)s]")
    server.add_argument("--checkpoint-every-steps", type=int, default=10,
                        help="a fine-tuning job saves a checkpoint (servable by name) every N "
                             "optimizer steps, and after its last [%(default)s]")
    server.add_argument("--max-concurrent-jobs", type=int, default=1,
                        help="fine-tuning jobs running at once (each holds a LoRA slot; must "
                             "be below --max-loras); others wait queued [%(default)s]")

    add_engine_arguments(parser)


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
    group = parser.add_argument_group("fine-tuning (token-level LoRA jobs; they need LoRA slots)")
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
    group = parser.add_argument_group("LoRA adapters (any of these options enables LoRA)")
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (loaded at start-up or at run time)")
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
    """LoRAConfig when --enable-lora or any LoRA option is given, else None."""
    given = {
        "max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras,
        "max_lora_rank": args.max_lora_rank, "allowed_adapter_dir": args.allowed_adapter_dir,
    }
    given = {k: v for k, v in given.items() if v is not None}
    modules = parse_lora_modules(args.lora_modules)
    if not (args.enable_lora or given or modules):
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
                                activation_offload=args.finetune_activation_offload),
        coserve=CoserveConfig(
            policy=args.coserve_policy, slo_tpot_ms=args.slo_tpot_ms,
            slo_ttft_ms=args.slo_ttft_ms, slo_margin=args.slo_margin,
            slo_tpot_mode=args.slo_tpot_mode,
            finetune_min_share=args.finetune_min_share,
            temporal_frequency=args.temporal_frequency, latency_profile=args.latency_profile,
            finetune_backward_stream=args.finetune_backward_stream),
        disable_log_stats=getattr(args, "disable_log_stats", False),
    )


def apply_state_dir(args: argparse.Namespace) -> None:
    """--state-dir: the model registry and the converters read it from the environment."""
    if args.state_dir:
        os.environ["FLEXSERVE_HOME"] = os.path.abspath(os.path.expanduser(args.state_dir))


def serve(args: argparse.Namespace) -> int:
    """Load the model, log what was built, run uvicorn until interrupted."""
    import uvicorn

    from flexserve.config import flexserve_home
    from flexserve.engine.async_engine import AsyncLLMEngine
    from flexserve.entrypoints.api_server import build_app
    from flexserve.entrypoints.auth import APIKeyTable
    from flexserve.entrypoints.finetune_service import FinetuneServiceConfig
    from flexserve.entrypoints.limits import AdmissionLimits
    from flexserve.entrypoints.shutdown import DrainingServer

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    apply_state_dir(args)
    config = engine_config_from_args(args)
    # --- reliability and security ---
    env_key = os.environ.get("FLEXSERVE_API_KEY")
    api_keys = APIKeyTable.from_sources(args.api_keys or ([env_key] if env_key else []),
                                        args.api_key_file)
    if args.max_queue_len < 0:
        raise ValueError(f"--max-queue-len must be >= 0, got {args.max_queue_len}")
    limits = AdmissionLimits(
        max_num_requests=config.scheduler.max_num_seqs + args.max_queue_len,
        max_num_requests_per_tenant=args.max_requests_per_tenant)
    if args.request_timeout_s is not None and not args.request_timeout_s > 0:
        raise ValueError(f"--request-timeout-s must be positive, got {args.request_timeout_s}")
    if not args.shutdown_grace_s >= 0:
        raise ValueError(f"--shutdown-grace-s must be >= 0, got {args.shutdown_grace_s}")
    # --- end reliability and security ---
    if args.max_upload_mb <= 0:
        raise ValueError(f"--max-upload-mb must be positive, got {args.max_upload_mb}")
    finetune = FinetuneServiceConfig(
        state_dir=flexserve_home(), checkpoint_every_steps=args.checkpoint_every_steps,
        max_concurrent_jobs=args.max_concurrent_jobs,
        max_upload_bytes=args.max_upload_mb * 1024 * 1024)
    logger.info("loading model %s (dtype %s, load format %s)", args.model, args.dtype,
                args.load_format)
    engine = AsyncLLMEngine.from_config(config, request_timeout_s=args.request_timeout_s)
    app = build_app(engine, served_model_name=args.served_model_name,
                    max_request_body_bytes=args.max_request_body_bytes, finetune=finetune,
                    api_keys=api_keys, limits=limits, allowed_origins=args.allowed_origins or (),
                    shutdown_grace_s=args.shutdown_grace_s)
    info = engine.info
    url = f"http://{args.host}:{args.port}"
    logger.info("model: %s served as %r | device: %s | dtype: %s | max_model_len: %d",
                info.name, app.state.served_model_name, info.device, info.dtype,
                info.max_model_len)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens | max_num_batched_tokens: %d | "
                "max_num_seqs: %d | prefix caching: %s", info.num_blocks, info.block_size,
                info.num_blocks * info.block_size, config.scheduler.max_num_batched_tokens,
                config.scheduler.max_num_seqs,
                "on" if config.cache.enable_prefix_caching else "off")
    if config.lora is not None:
        lora = config.lora
        names = ", ".join(r.lora_name for r in engine.list_loras()) or "none yet"
        logger.info("LoRA: max_loras %d (slots of rank %d), max_cpu_loras %d, allowed adapter "
                    "dir: %s | adapters: %s", lora.max_loras, lora.max_lora_rank,
                    lora.max_cpu_loras, lora.allowed_adapter_dir or "any", names)
    logger.info("fine-tuning jobs: state in %s | checkpoint every %d steps | %d at once | "
                "uploads up to %d MiB", app.state.finetune.store.root,
                finetune.checkpoint_every_steps, finetune.max_concurrent_jobs,
                args.max_upload_mb)
    if api_keys is None:
        logger.info("API keys: none, /v1/* is open to anyone who can connect")
    else:
        logger.info("API keys: %d required on /v1/* (tenants: %s)", len(api_keys),
                    ", ".join(sorted(api_keys.tenants)) or "none")
    logger.info("limits: %d generation requests in flight (%d running + %d queued)%s | request "
                "timeout: %s | shutdown grace: %g s | CORS: %s", limits.max_num_requests,
                config.scheduler.max_num_seqs, args.max_queue_len,
                "" if args.max_requests_per_tenant is None
                else f", {args.max_requests_per_tenant} per tenant",
                "none" if args.request_timeout_s is None else f"{args.request_timeout_s:g} s",
                args.shutdown_grace_s, ", ".join(args.allowed_origins or ()) or "off")
    logger.info("serving on %s (OpenAI base_url %s/v1; docs %s/openapi.json; metrics %s/metrics)",
                url, url, url, url)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level,
                                           timeout_graceful_shutdown=5),
                            app.state.shutdown)
    try:
        server.run()  # returns after SIGTERM/SIGINT and the drain
    finally:
        engine.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexserve", description="Serve LLMs with an OpenAI-compatible API.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_parser = commands.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible HTTP server (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /v1/files, /v1/fine_tuning/jobs, "
                    "/v1/load_lora_adapter, "
                    "/v1/unload_lora_adapter, /health, /version, /metrics).")
    add_serve_arguments(serve_parser)
    serve_parser.set_defaults(handler=serve)
    from flexserve.entrypoints.bench import add_bench_parser

    add_bench_parser(commands)
    from flexserve.entrypoints.finetune_plan import add_finetune_plan_parser

    add_finetune_plan_parser(commands)
    from flexserve.entrypoints.profile import add_profile_parser

    add_profile_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, getattr(args, "log_level", "info").upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.handler(args)
    except ValueError as e:  # a bad option or model: a message, not a traceback
        parser.exit(2, f"flexserve {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())

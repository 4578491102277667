"""`flexserve serve`: the OpenAI-compatible server over one engine."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from flexserve import envs
from flexserve.entrypoints.cli.args import (
    add_engine_arguments,
    apply_state_dir,
    engine_config_from_args,
)
from flexserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("flexserve.serve")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


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
    server.add_argument("--admin-api-key", action="append", default=None,
                        help="an operator key (repeatable): loads, unloads and lists every "
                             "tenant's adapters and models; adapters it loads serve all tenants "
                             "[$FLEXSERVE_ADMIN_API_KEY, else none]")
    server.add_argument("--max-queue-len", type=int, default=1024,
                        help="generation requests waiting beyond --max-num-seqs running; past "
                             "it new ones get 429 with Retry-After [%(default)s]")
    server.add_argument("--max-requests-per-tenant", type=int, default=None,
                        help="generation requests one tenant may have in flight; past it 429 "
                             "[unlimited]")
    server.add_argument("--max-seqs-per-tenant", type=int, default=None,
                        help="sequences (prompts x n) one tenant may have in flight; past it "
                             "429 [unlimited; all tenants together: max-num-seqs + "
                             "max-queue-len]")
    server.add_argument("--max-tokens-per-tenant", type=int, default=None,
                        help="tokens (prompt plus max_tokens, per sequence) one tenant may have "
                             "in flight; past it 429 [unlimited]")
    server.add_argument("--request-timeout-s", type=float, default=None,
                        help="abort a request still running this long after it arrived (408, "
                             "KV freed) [no limit]")
    server.add_argument("--shutdown-grace-s", type=float, default=30.0,
                        help="on SIGTERM: time for requests in flight to finish (new ones get "
                             "503) and for running jobs to checkpoint [%(default)s]")
    server.add_argument("--metrics-job-ids", action="store_true",
                        help="name fine-tuning jobs and tenants' adapters in /metrics labels and "
                             "/health (both answer without a key) [off: job_id=\"all\", "
                             "lora_name=\"private\"]")
    server.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                        help="enable CORS for these browser origins (`*`: any) [CORS off]")
    server.add_argument("--served-model-name", default=None,
                        help="the model name clients use [the --model value]")
    server.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="read tool calls out of replies under tool_choice 'auto': hermes "
                             "(Qwen2.5, Hermes: <tool_call> tags), llama3_json (Llama 3.x) "
                             "['auto' refused]")
    server.add_argument("--max-request-body-bytes", type=int, default=10 * 1024 * 1024,
                        help="larger request bodies get 413 [%(default)s]")
    server.add_argument("--log-level", choices=LOG_LEVELS, default="info",
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
    server.add_argument("--keep-checkpoints", type=int, default=3,
                        help="newest checkpoints of each fine-tuning job kept on disk (older "
                             "ones are deleted; the newest, the final model once the job ends, "
                             "always stays) [%(default)s]")
    server.add_argument("--max-concurrent-jobs", type=int, default=None,
                        help="at most this many fine-tuning jobs running at once; others wait "
                             "queued [as many as the fine-tuning slots and memory hold]")

    add_engine_arguments(parser)


def add_serve_parser(commands: Any) -> None:
    """`flexserve serve` and its options."""
    parser = commands.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible HTTP server (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /v1/files, /v1/fine_tuning/jobs, "
                    "/v1/load_lora_adapter, "
                    "/v1/unload_lora_adapter, /health, /version, /metrics).")
    add_serve_arguments(parser)
    parser.set_defaults(handler=serve)


def serve(args: argparse.Namespace) -> int:
    """Load the model, log what was built, run uvicorn until interrupted."""
    import uvicorn

    from flexserve.entrypoints.engine_builder import build_async_engine, freeze_startup_objects
    from flexserve.entrypoints.openai.api_server import build_app
    from flexserve.entrypoints.openai.auth import APIKeyTable
    from flexserve.entrypoints.openai.limits import AdmissionLimits
    from flexserve.entrypoints.openai.shutdown import DrainingServer
    from flexserve.finetune.service import FinetuneServiceConfig

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    apply_state_dir(args)
    config = engine_config_from_args(args)
    # --- reliability and security ---
    env_key = envs.api_key()
    env_admin_key = envs.admin_api_key()
    api_keys = APIKeyTable.from_sources(
        args.api_keys or ([env_key] if env_key else []), args.api_key_file,
        args.admin_api_key or ([env_admin_key] if env_admin_key else []))
    if args.max_queue_len < 0:
        raise ValueError(f"--max-queue-len must be >= 0, got {args.max_queue_len}")
    limits = AdmissionLimits(
        max_num_requests=config.scheduler.max_num_seqs + args.max_queue_len,
        max_num_requests_per_tenant=args.max_requests_per_tenant,
        max_num_sequences=config.scheduler.max_num_seqs + args.max_queue_len,
        max_num_sequences_per_tenant=args.max_seqs_per_tenant,
        max_num_tokens_per_tenant=args.max_tokens_per_tenant)
    if args.request_timeout_s is not None and not args.request_timeout_s > 0:
        raise ValueError(f"--request-timeout-s must be positive, got {args.request_timeout_s}")
    if not args.shutdown_grace_s >= 0:
        raise ValueError(f"--shutdown-grace-s must be >= 0, got {args.shutdown_grace_s}")
    if args.max_upload_mb <= 0:
        raise ValueError(f"--max-upload-mb must be positive, got {args.max_upload_mb}")
    finetune = FinetuneServiceConfig(
        state_dir=envs.home(), checkpoint_every_steps=args.checkpoint_every_steps,
        max_concurrent_jobs=args.max_concurrent_jobs,
        max_upload_bytes=args.max_upload_mb * 1024 * 1024, keep_checkpoints=args.keep_checkpoints)
    logger.info("loading model %s (dtype %s, load format %s)", args.model, args.dtype,
                args.load_format)
    engine = build_async_engine(config, request_timeout_s=args.request_timeout_s)
    app = build_app(engine, served_model_name=args.served_model_name,
                    max_request_body_bytes=args.max_request_body_bytes, finetune=finetune,
                    api_keys=api_keys, limits=limits, allowed_origins=args.allowed_origins or (),
                    metrics_job_ids=args.metrics_job_ids,
                    shutdown_grace_s=args.shutdown_grace_s,
                    tool_call_parser=args.tool_call_parser)
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
        capacity = engine.engine.finetune_capacity
        if capacity is not None:
            logger.info("fine-tuning capacity: %s", capacity.describe())
    logger.info("fine-tuning jobs: state in %s | checkpoint every %d steps, newest %d kept | "
                "%s at once | uploads up to %d MiB", app.state.finetune.store.root,
                finetune.checkpoint_every_steps, finetune.keep_checkpoints,
                finetune.max_concurrent_jobs or "as many as fit", args.max_upload_mb)
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
    freeze_startup_objects()  # the engine lives as long as this process
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level,
                                           timeout_graceful_shutdown=5),
                            app.state.shutdown)
    try:
        server.run()  # returns after SIGTERM/SIGINT and the drain
    finally:
        engine.shutdown()
    return 0

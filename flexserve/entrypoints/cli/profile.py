"""`flexserve profile`: time real iterations on this device and fit the latency model.

Builds the engine's executor from the usual engine options (LoRA is switched on when none was
asked for: fine-tuning iterations need a slot), runs the profiling grid with a progress bar
(`flexserve.worker.profiler`), fits `LatencyModel` on the grid's iterations, prints its error on
held-out random iterations, and saves the JSON where `flexserve serve` finds it for this device,
model, dtype and number of tensor-parallel ranks (`profile_path` in the state directory), or to
`--out`. With `--tensor-parallel-size N` it times the ranks' iterations, collectives included,
as a server with N ranks runs them.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from flexserve.entrypoints.cli.args import (
    add_engine_arguments,
    apply_state_dir,
    engine_config_from_args,
)

logger = logging.getLogger("flexserve.profile")


def add_profile_parser(commands: Any) -> argparse.ArgumentParser:
    """Register `profile` on the `flexserve` subcommands."""

    parser = commands.add_parser(
        "profile", help="fit the hybrid scheduler's latency model on this device",
        description="Time synthetic iterations (prefill chunks, decode batches, fine-tuning "
                    "forward and backward windows, mixes of them) on this device and model, fit "
                    "the latency model the hybrid token scheduler sizes fine-tuning windows with "
                    "(FlexLLM 6.2), report its error on held-out iterations, and save it where "
                    "`flexserve serve` loads it.")
    group = parser.add_argument_group("profiling")
    group.add_argument("--out", default=None,
                       help="write the profile here [<state dir>/profiles/<device>__<model>__"
                            "<dtype>.json, which `serve` loads]")
    group.add_argument("--quick", action="store_true",
                       help="a small grid that fits a CPU (about a minute for SmolLM2-135M); "
                            "the default grid is meant for GPUs")
    group.add_argument("--repeats", type=int, default=3,
                       help="timed runs per iteration shape; the median counts [%(default)s]")
    group.add_argument("--warmup", type=int, default=1,
                       help="untimed runs per shape before those [%(default)s]")
    group.add_argument("--finetune-target-modules", nargs="+", default=None, metavar="MODULE",
                       help="the LoRA targets of the profiling job; a linear that no job targets "
                            "skips its LoRA kernels, so profile what the jobs will train "
                            "[all seven projections: the most expensive job]")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    group.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"),
                       help="[%(default)s]")
    add_engine_arguments(parser)
    parser.set_defaults(handler=profile)
    return parser


def profile(args: argparse.Namespace) -> int:
    """Build the executor, profile, fit, report, save."""
    from flexserve import __version__, envs
    from flexserve.config import LoRAConfig
    from flexserve.engine.latency_model import profile_path
    from flexserve.finetune.hyperparameters import Hyperparameters
    from flexserve.worker.builder import build_executor
    from flexserve.worker.profile_grid import ProfileGrid
    from flexserve.worker.profiler import device_name, fit_profile, profile_executor

    if args.repeats < 1 or args.warmup < 0:
        raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and "
                         f"{args.warmup}")
    apply_state_dir(args)
    config = engine_config_from_args(args)
    if config.parallel.pipeline_parallel_size > 1:
        raise ValueError("flexserve profile times the iterations of one stage's ranks: profile "
                         "with --pipeline-parallel-size 1")
    tp = config.parallel.tensor_parallel_size
    if config.lora is None:
        config.lora = LoRAConfig(max_loras=1)  # the profiling job's adapter needs one slot
    config.finetune.warmup = False  # the profile's own warm-up round compiles the kernels
    executor, _, info = build_executor(config)
    # The engine looks profiles up by the name its builder records (the same formula).
    device = getattr(info, "device_name", "") or device_name(executor.device)
    max_finetune_len = config.finetune.max_finetune_len or info.max_model_len
    grid = ProfileGrid.default(config.scheduler.max_num_batched_tokens, info.max_model_len,
                               config.scheduler.max_num_seqs, max_finetune_len, quick=args.quick)
    logger.info("profiling %s (%s, %d layers) on %s: %d inference shapes, %d fine-tuning "
                "scenarios, %d timed runs each after %d warm-up", info.name, info.dtype,
                info.num_layers, device, len(grid.inference), len(grid.finetune), args.repeats,
                args.warmup)
    targets = args.finetune_target_modules
    if targets is not None:
        Hyperparameters.from_dict({"lora": {"target_modules": targets}})  # ValueError if unknown
    result = profile_executor(executor, info, grid, repeats=args.repeats, warmup=args.warmup,
                              progress=not args.no_progress, target_modules=targets,
                              max_lora_rank=config.lora.max_lora_rank)
    metadata = {
        "device_name": device, "model": info.name, "dtype": info.dtype,
        "tensor_parallel_size": tp,
        "finetune_target_modules": targets or "all",
        "num_layers": info.num_layers, "created": time.time(), "flexserve_version": __version__,
        "quick": args.quick, "repeats": args.repeats, "warmup": args.warmup,
        "grid": grid.to_dict(),
    }
    model = fit_profile(result, metadata)
    path = args.out or profile_path(envs.home(), device, info.name, info.dtype, tp)
    model.save(path)
    fit, heldout = model.metadata["fit"], model.metadata["heldout"]
    print(f"profiled {result.num_iterations} iterations in {result.seconds:.1f} s: "
          f"{len(result.samples)} grid shapes, {len(result.heldout)} held-out")
    print(f"fit error on the grid:  median {fit['median_rel_error']:.1%}, "
          f"p90 {fit['p90_rel_error']:.1%}, max {fit['max_rel_error']:.1%}")
    print(f"held-out error:         median {heldout['median_rel_error']:.1%}, "
          f"p90 {heldout['p90_rel_error']:.1%}, max {heldout['max_rel_error']:.1%} "
          f"({heldout['num_samples']} iterations)")
    coef = model.coefficient_dict()
    print(f"fixed costs: an iteration {coef['forward'] * 1e3:.2f} ms, a mixed iteration "
          f"{coef['eager'] * 1e3:.2f} ms over a decode-only one, a forward window "
          f"{coef['finetune_windows'] * 1e3:.2f} ms, a backward window "
          f"{coef['backward_windows'] * 1e3:.2f} ms")
    print("ms per unit (non-zero): " + ", ".join(
        f"{name} {value * 1e3:.4g}" for name, value in model.coefficient_dict().items()
        if value > 0))
    print(f"saved {path}")
    return 0

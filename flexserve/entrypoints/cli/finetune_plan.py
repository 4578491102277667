"""`flexserve finetune-plan`: what fine-tuning keeps per token after graph pruning (FlexLLM 5.2).

Only the model's config is read, so shipped architecture names (`llama-3.1-8b`) work without
weights. For the requested bypass networks it prints, per decoder layer, every tensor the backward
needs and how it is kept (stored, KV cache, rematerialized) with its bytes per token, and
beside the totals what ordinary PyTorch autograd keeps for the same layer (measured on the CPU
with HF transformers + peft, see `AutogradProbe`) and the reduction. With `--max-finetune-len`
(and `--finetune-activation-budget`), it also prints the plan of every layer a job would use
(`flexserve.peft.activation_budget.plan_layers`) and one sequence's activation bytes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from flexserve.config import DEFAULT_MODEL
from flexserve.peft.activation_budget import (
    GIB,
    NUM_SLOTS,
    LayerPlans,
    budget_bytes_from_gib,
    plan_layers,
)
from flexserve.peft.bypass import TARGET_MODULES
from flexserve.peft.graph_pruning import (
    DEFAULT_REMAT_THRESHOLD,
    AutogradProbe,
    PruningPlan,
    plan_pruning,
)
from flexserve.peft.ia3 import IA3_DEFAULT_TARGETS
from flexserve.peft.layer_graph import BYPASS_KINDS, build_layer_graph

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# PEFT's default target modules for a Llama-family model, per bypass kind.
DEFAULT_TARGETS = {"lora": ("q_proj", "v_proj"), "ia3": IA3_DEFAULT_TARGETS}


def add_finetune_plan_parser(commands: Any) -> argparse.ArgumentParser:
    """Register `finetune-plan` on the `flexserve` subcommands."""
    parser = commands.add_parser(
        "finetune-plan", help="show which activations fine-tuning keeps (graph pruning)",
        description="Run FlexLLM's static graph pruning (algorithm 1) on one decoder layer of "
                    "MODEL with bypass networks on TARGETS, and print what the backward needs "
                    "per token: stored, KV cache or rematerialized, against what plain "
                    "PyTorch autograd keeps.")
    add_finetune_plan_arguments(parser)
    parser.set_defaults(handler=finetune_plan)
    return parser


def add_finetune_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a shipped model name (e.g. llama-3.1-8b) or a Hugging Face "
                             "directory; only its config is read [%(default)s]")
    parser.add_argument("--targets", default=None,
                        help="comma-separated projections, or all-linear [PEFT's default: "
                             "q_proj,v_proj for lora, k_proj,v_proj,down_proj for ia3]")
    parser.add_argument("--bypass", default="lora", help="lora or ia3 [%(default)s]")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank [%(default)s]")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="LoRA dropout; planned folded into LoRA A (its mask is regenerated "
                        "from its seed), so the plan is the one without dropout [%(default)s]")
    parser.add_argument("--remat-threshold", type=float, default=None,
                        help="rematerialize a tensor when recomputing it costs less than this "
                             f"fraction of the layer's forward FLOPs [{DEFAULT_REMAT_THRESHOLD}; "
                             "the budget's chained layers: 0.6]")
    parser.add_argument("--remat-chains", action="store_true",
                        help="beyond algorithm 1: also recompute through tensors the backward "
                             "does not read (e.g. gate/up from x_mid), within the threshold")
    parser.add_argument("--max-finetune-len", type=int, default=None,
                        help="tokens of the longest sequence: also print every layer's plan and "
                             "one sequence's activation bytes")
    parser.add_argument("--finetune-activation-budget", type=float, default=None, metavar="GIB",
                        help="as for serve: GiB a --max-finetune-len sequence's activations may "
                             "take; the lowest layers get remat chains until it fits")
    parser.add_argument("--finetune-activation-offload", action="store_true",
                        help="as for serve: under the budget, every other layer's activations "
                             "go to pinned host memory before any layer gets remat chains")
    parser.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or float16 "
                        "[%(default)s]")
    parser.add_argument("--num-layers-shown", type=int, default=3,
                        help="per-layer rows before the whole-model total [%(default)s]")
    parser.add_argument("--layer0-input-grad", action="store_true",
                        help="something below layer 0 trains (e.g. embeddings): keep layer 0's "
                             "input gradient, which PEFT on decoder layers never needs")
    parser.add_argument("--no-autograd", action="store_true",
                        help="skip measuring full autograd (it builds one real-width layer on "
                             "the CPU: ~2 s and ~0.5 GB for an 8B model in bfloat16)")


def parse_targets(value: str | None, bypass: str) -> tuple[str, ...]:
    """--targets as target names in layer order; ValueError for unknown ones."""
    if bypass not in BYPASS_KINDS:
        raise ValueError(f"unknown --bypass {bypass!r}; known: {', '.join(BYPASS_KINDS)}")
    if value is None:
        return DEFAULT_TARGETS[bypass]
    if value.strip() == "all-linear":
        return tuple(TARGET_MODULES)
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise ValueError("--targets names no module")
    unknown = [name for name in names if name not in TARGET_MODULES]
    if unknown:
        raise ValueError(f"unknown target module(s) {', '.join(map(repr, unknown))} in "
                         f"--targets; known: {', '.join(TARGET_MODULES)} (or all-linear)")
    return tuple(t for t in TARGET_MODULES if t in names)


def _check_args(args: argparse.Namespace) -> None:
    if args.dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown --dtype {args.dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    if args.rank < 1:
        raise ValueError(f"--rank must be >= 1, got {args.rank}")
    if not 0.0 <= args.dropout < 1.0:
        raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.dropout > 0 and args.bypass != "lora":
        raise ValueError("--dropout applies to LoRA only; (IA)3 has no dropout")
    if args.remat_threshold is not None and not 0.0 <= args.remat_threshold < float("inf"):
        raise ValueError(f"--remat-threshold must be a finite number >= 0, got "
                         f"{args.remat_threshold}")
    if args.max_finetune_len is not None and args.max_finetune_len < 1:
        raise ValueError(f"--max-finetune-len must be >= 1, got {args.max_finetune_len}")
    budget = args.finetune_activation_budget
    if budget is not None:
        if not 0.0 < budget < float("inf"):
            raise ValueError(f"--finetune-activation-budget must be a positive number of GiB, "
                             f"got {budget}")
        if args.max_finetune_len is None:
            raise ValueError("--finetune-activation-budget needs --max-finetune-len: the budget "
                             "holds one sequence of that many tokens")
    elif args.finetune_activation_offload:
        raise ValueError("--finetune-activation-offload needs --finetune-activation-budget: "
                         "layers go to host memory only as far as the budget needs")
    if args.num_layers_shown < 1:
        raise ValueError(f"--num-layers-shown must be >= 1, got {args.num_layers_shown}")


def finetune_plan(args: argparse.Namespace) -> int:
    """Plan layer 0 and the layers above it, print the tables; ValueError for bad options."""
    from flexserve.model.registry import resolve_model

    targets = parse_targets(args.targets, args.bypass)
    _check_args(args)
    hf_config = resolve_model(args.model).hf_config
    bypass = dict.fromkeys(targets, args.bypass)
    graph = build_layer_graph(hf_config, bypass, rank=args.rank, dropout=args.dropout)
    dtype_bytes = DTYPE_BYTES[args.dtype]
    num_layers = hf_config.num_hidden_layers
    # Layer 0's input gradient is pruned unless asked for; every layer above needs its own.
    grads = {args.layer0_input_grad} | ({True} if num_layers > 1 else set())
    threshold = DEFAULT_REMAT_THRESHOLD if args.remat_threshold is None else args.remat_threshold
    # Checked before the autograd measurement: an impossible budget fails at once.
    layers = None if args.max_finetune_len is None else plan_layers(
        graph, dtype_bytes, num_layers, args.remat_threshold, args.remat_chains,
        budget_bytes_from_gib(args.finetune_activation_budget), args.max_finetune_len,
        layer0_input_grad=args.layer0_input_grad, offload=args.finetune_activation_offload)
    plans = {grad: plan_pruning(graph, dtype_bytes, threshold, input_grad=grad,
                                chains=args.remat_chains)
             for grad in sorted(grads, reverse=True)}
    # Measured autograd bytes per input_grad: (backbone frozen, backbone trainable).
    autograd: dict[bool, tuple[int, int] | None] = dict.fromkeys(plans)
    if not args.no_autograd:
        probe = AutogradProbe(hf_config, bypass, args.dtype, rank=args.rank, dropout=args.dropout)
        for grad in plans:
            autograd[grad] = (probe.bytes_per_token(grad, frozen_backbone=True),
                              probe.bytes_per_token(grad, frozen_backbone=False))

    kind = f"LoRA r={args.rank}, dropout {args.dropout:g}" if args.bypass == "lora" else "(IA)3"
    first = next(iter(plans.values()))
    print(f"model {args.model}: {num_layers} layers, hidden {hf_config.hidden_size}, "
          f"intermediate {hf_config.intermediate_size}")
    print(f"bypass: {kind} on {', '.join(targets)} | dtype {args.dtype} | remat threshold "
          f"{first.remat_threshold:g} x {first.layer_flops_per_token / 1e6:.3g} MFLOP/token/layer"
          f"{' (with chains, beyond algorithm 1)' if first.chains else ''}")
    if args.layer0_input_grad:
        _print_layer("every layer (the gradient of x is needed)", plans[True], autograd[True])
    else:
        if num_layers > 1:
            above = f"layers 1-{num_layers - 1}" if num_layers > 2 else "layer 1"
            _print_layer(f"{above} (the gradient of x is needed)", plans[True], autograd[True])
        _print_layer("layer 0 (nothing below trains: its input gradient is pruned)",
                     plans[False], autograd[False])
    _print_model(plans, autograd, num_layers, args.layer0_input_grad, args.num_layers_shown)
    if layers is not None:
        print_layer_plans(layers)
    return 0


def _reduction(ours: int, theirs: int | None) -> str:
    return "-" if not theirs else f"{100.0 * (1 - ours / theirs):.1f}%"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.1f} KiB"


def _print_layer(title: str, plan: PruningPlan, autograd: tuple[int, int] | None) -> None:
    print(f"\n{title}")
    print(f"{'tensor':<16}{'width':>7}  {'kept as':<16}{'B/token':>9}  read by the backward of")
    for t in plan.tensors:
        kept = "bitmask" if t.compression else t.status.replace("_", " ")
        line = (f"{t.name:<16}{t.width:>7}  {kept:<16}{t.bytes_per_token:>9}  "
                f"{', '.join(t.needed_by)}")
        if t.status == "rematerialized":
            line += f"  (from {', '.join(t.recompute_from)}, {t.recompute_flops / 1e3:.0f} KFLOP)"
        print(line)
    print(f"total {plan.bytes_per_token:,} B/token/layer | unpruned (backbone weight gradients "
          f"kept): {plan.unpruned_bytes_per_token:,} B")
    if autograd is not None:
        frozen, trainable = autograd
        print(f"full autograd (measured): {frozen:,} B/token/layer with the backbone frozen, "
              f"{trainable:,} B trainable (no pruning at all)")
        print(f"reduction: {_reduction(plan.bytes_per_token, frozen)} vs autograd with the "
              f"backbone frozen, {_reduction(plan.bytes_per_token, trainable)} vs trainable")


def _print_model(plans: dict[bool, PruningPlan], autograd: dict[bool, tuple[int, int] | None],
                 num_layers: int, layer0_grad: bool, num_shown: int) -> None:
    def row(layer: int) -> tuple[int, int | None]:  # plan bytes, autograd (frozen) bytes
        grad = True if layer > 0 else layer0_grad
        measured = autograd[grad]
        return plans[grad].bytes_per_token, None if measured is None else measured[0]

    print(f"\n{'layer':<8}{'plan B/token':>14}{'autograd B/token':>18}{'reduction':>11}")
    for layer in range(min(num_shown, num_layers)):
        ours, theirs = row(layer)
        print(f"{layer:<8}{ours:>14,}{_count(theirs):>18}{_reduction(ours, theirs):>11}")
    if num_shown < num_layers:
        print(f"... layers {num_shown}-{num_layers - 1}: as layer 1")
    ours = sum(row(layer)[0] for layer in range(num_layers))
    theirs_rows = [row(layer)[1] for layer in range(num_layers)]
    theirs = None if None in theirs_rows else sum(theirs_rows)
    print(f"{'model':<8}{ours:>14,}{_count(theirs):>18}{_reduction(ours, theirs):>11}"
          f"   ({_size(ours)} per token over {num_layers} decoder layers"
          + ("" if theirs is None else f" vs {_size(theirs)}") + ")")


def print_layer_plans(layers: LayerPlans) -> None:
    """Every layer's plan (consecutive layers with one plan on one row) and the bytes of one
    `max_num_tokens`-token sequence, against the budget if there is one."""
    tokens = layers.max_num_tokens
    if layers.budget_bytes is None:
        print(f"\nevery layer's plan, one {tokens}-token sequence (no activation budget)")
    else:
        mix = (f"{len(layers.lean_layers)} of {len(layers.plans)} layers with remat chains at "
               f"threshold {layers.lean_threshold:g} (the lowest ones)")
        if layers.offload_layers:
            mix = (f"{len(layers.offload_layers)} of {len(layers.plans)} layers in pinned host "
                   f"memory (every other from layer 1), {len(layers.lean_layers)} with remat "
                   f"chains at threshold {layers.lean_threshold:g}")
        print(f"\nactivation budget {layers.budget_bytes / GIB:g} GiB for one {tokens}-token "
              f"sequence: {mix}")
    print(f"{'layers':<10}{'plan':<50}{'B/token':>10}{'GiB':>9}  stores")
    first = 0
    for layer in range(1, len(layers.plans) + 1):
        plan = layers.plans[first]
        if layer < len(layers.plans) and layers.plans[layer] is plan:
            continue
        span = f"{first}" if layer - 1 == first else f"{first}-{layer - 1}"
        kind = (f"{'chains' if plan.chains else 'algorithm 1'}, threshold "
                f"{plan.remat_threshold:g}{'' if plan.input_grad else ', no input gradient'}")
        num_bytes = plan.bytes_per_token * (layer - first)
        print(f"{span:<10}{kind:<50}{plan.bytes_per_token:>10,}{num_bytes * tokens / GIB:>9.3f}"
              f"  {', '.join(sorted(plan.stored)) or '-'}")
        first = layer
    if layers.offload_layers:
        host = layers.host_bytes_per_token
        ring = layers.device_bytes_per_token - (layers.bytes_per_token - host)
        print(f"{'offload':<10}{'in pinned host memory: layers ' + _spans(layers.offload_layers):<50}"
              f"{-host:>10,}{-host * tokens / GIB:>9.3f}")
        print(f"{'ring':<10}{f'{NUM_SLOTS} device slots of one layer':<50}"
              f"{ring:>10,}{ring * tokens / GIB:>9.3f}")
    total = layers.num_bytes
    label = "on device" if layers.offload_layers else "total"
    print(f"{label:<10}{'':<50}{layers.device_bytes_per_token:>10,}{total / GIB:>9.3f}  "
          f"({total / 1e9:.3f} GB for {tokens} tokens"
          + ("" if layers.budget_bytes is None else
             f", budget {layers.budget_bytes / GIB:g} GiB") + ")")


def _spans(layers: tuple[int, ...]) -> str:
    """1, 3, 5, 7 -> "1-7 odd"; other sets as a list."""
    if len(layers) > 2 and all(b - a == 2 for a, b in zip(layers, layers[1:])):
        return f"{layers[0]}, {layers[1]}, ..., {layers[-1]}"
    return ", ".join(map(str, layers))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m flexserve.entrypoints.cli.finetune_plan ...`, same options as the subcommand."""
    parser = argparse.ArgumentParser(prog="flexserve finetune-plan")
    add_finetune_plan_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return finetune_plan(args)
    except ValueError as e:
        parser.exit(2, f"flexserve finetune-plan: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())

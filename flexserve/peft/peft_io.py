"""Adapters in the `peft` format: `adapter_config.json` + `adapter_model.safetensors`.

Two kinds: LoRA (`peft_type` "LORA", `LoRAAdapter`) and (IA)3 ("IA3", `IA3Adapter`); the loader
dispatches on `peft_type`, and a caller names the kinds it can use (serving takes LoRA only).
Reading checks everything a server must not trust: the files exist, the config is a plain LoRA
(no DoRA, biases, extra saved modules or per-module ranks) or a plain (IA)3, every tensor targets
one of the seven projections a Llama-family layer has, the shapes fit the loaded model, and the
rank fits the slots. Each problem is a `ValueError` whose message says what is wrong. Pickled
`adapter_model.bin` files are refused: loading them would run arbitrary code from a user-supplied
directory.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from flexserve.peft.bypass import TARGET_MODULES
from flexserve.peft.ia3 import IA3Adapter
from flexserve.peft.lora import LoRAAdapter

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"

# PEFT's saved keys: base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight
# (an adapter saved from a bare LlamaModel lacks one `model.`; a named one may keep `.default`).
_KEY = re.compile(
    r"^(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+?)\.lora_(A|B)(?:\.default)?\.weight$"
)
# Config entries that change what the adapter computes; a truthy value is refused.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "fan_in_fan_out": "transposed (Conv1D) weights (fan_in_fan_out)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
}
_SUPPORTED = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
PEFT_TYPES = ("LORA", "IA3")
# PEFT's saved (IA)3 keys: ...layers.{i}.{self_attn|mlp}.{target}.ia3_l, [out, 1] or [1, in].
_IA3_KEY = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+?)\.ia3_l(?:\.default)?$")
_UNSUPPORTED_IA3_OPTIONS = {
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "fan_in_fan_out": "transposed (Conv1D) weights (fan_in_fan_out)",
}


def resolve_adapter_dir(path: str, allowed_dir: str | None = None) -> str:
    """The adapter directory as a real path; ValueError when missing or outside `allowed_dir`.

    Symlinks and `..` are resolved before the containment check, so neither can escape it.
    """
    if not isinstance(path, str) or not path:
        raise ValueError("the adapter path must be a non-empty string")
    real = os.path.realpath(os.path.expanduser(path))
    if allowed_dir is not None and not _is_inside(real, allowed_dir):
        # The allowed directory itself is not named: error bodies never show server paths.
        raise ValueError(
            f"adapter path {path!r} is outside the allowed adapter directory "
            "(--allowed-adapter-dir)"
        )
    if not os.path.exists(real):
        raise ValueError(f"adapter directory {path!r} does not exist")
    if not os.path.isdir(real):
        raise ValueError(f"adapter path {path!r} is not a directory")
    return real


def _is_inside(real_path: str, directory: str) -> bool:
    """`real_path` (already resolved) lies in `directory` (resolved here: symlinks, `..`, `~`)."""
    allowed = os.path.realpath(os.path.expanduser(directory))
    return os.path.commonpath([real_path, allowed]) == allowed


def adapter_file(directory: str, name: str, allowed_dir: str | None = None) -> str:
    """The real path of file `name` of an adapter directory. With `allowed_dir`, a file that is a
    symlink resolving outside it is refused (ValueError): checking the directory alone would let
    `adapter_model.safetensors -> /elsewhere/...` read any file the server can."""
    real = os.path.realpath(os.path.join(directory, name))
    if allowed_dir is not None and not _is_inside(real, allowed_dir):
        raise ValueError(f"{name} of the adapter links outside the allowed adapter directory "
                         "(--allowed-adapter-dir)")
    return real


def _reason(e: BaseException) -> str:
    """An I/O error's reason without the path it names (error bodies never show server paths)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e)


def read_adapter_config(path: str, allowed_dir: str | None = None) -> dict[str, Any]:
    """The parsed adapter_config.json of a directory; ValueError when missing or malformed, or
    (with `allowed_dir`) when it links outside that directory."""
    config_path = adapter_file(path, ADAPTER_CONFIG_NAME, allowed_dir)
    if not os.path.isfile(config_path):
        raise ValueError(f"{ADAPTER_CONFIG_NAME} is missing in the adapter directory")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {ADAPTER_CONFIG_NAME}: {_reason(e)}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{ADAPTER_CONFIG_NAME} must hold a JSON object")
    return config


def parse_lora_config(config: dict[str, Any]) -> dict[str, Any]:
    """The LoRA hyper-parameters of an adapter config (PEFT's defaults for absent keys).

    Returns {r, lora_alpha, use_rslora, lora_dropout, target_modules, base_model_name_or_path}.
    """
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"peft_type {peft_type!r} is not supported; only LORA adapters are")
    rank = config.get("r", 8)
    if type(rank) is not int or rank <= 0:
        raise ValueError(f"adapter config: r must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"adapter config: lora_alpha must be a number, got {alpha!r}")
    dropout = config.get("lora_dropout", 0.0) or 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"adapter config: lora_dropout must be in [0, 1), got {dropout!r}")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise ValueError(f"adapter config: bias={bias!r} is not supported (only 'none')")
    for key, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(key):
            raise ValueError(f"adapter config: {what} is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in TARGET_MODULES]
        if unknown:
            raise ValueError(
                f"unsupported LoRA target module(s) {', '.join(map(str, unknown))}; supported: "
                f"{_SUPPORTED}"
            )
    elif targets is not None and not isinstance(targets, str):  # a regex or "all-linear"
        raise ValueError(
            f"adapter config: target_modules must be a list or a string, got {targets!r}")
    return {
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": bool(config.get("use_rslora", False)),
        "lora_dropout": float(dropout),
        "target_modules": targets,
        "base_model_name_or_path": config.get("base_model_name_or_path"),
    }


def load_peft_adapter(
    path: str,
    shapes: dict[str, tuple[int, int]] | None = None,
    num_layers: int | None = None,
    max_rank: int | None = None,
    allowed_dir: str | None = None,
    dtype: torch.dtype | None = None,
    peft_types: tuple[str, ...] = ("LORA",),
) -> LoRAAdapter | IA3Adapter:
    """Read a PEFT adapter directory into a `LoRAAdapter` or an `IA3Adapter` on the CPU.

    The config's `peft_type` picks the kind; `peft_types` lists those the caller accepts (the
    default, LoRA only, is what the serving path can run: a LoRA caller never gets another kind).
    With `shapes` ((in, out) per target, see `bypass.target_shapes`) and `num_layers` the adapter
    is checked against the base model; with `max_rank` a LoRA rank against the slots. `dtype`
    casts the weights. Raises ValueError naming the problem.
    """
    unknown = [t for t in peft_types if t not in PEFT_TYPES]
    if unknown:
        raise ValueError(f"unknown peft type(s) {unknown}; known: {', '.join(PEFT_TYPES)}")
    real = resolve_adapter_dir(path, allowed_dir)
    config = read_adapter_config(real, allowed_dir)
    peft_type = config.get("peft_type", "LORA")
    if peft_type not in peft_types:
        raise ValueError(
            f"peft_type {peft_type!r} is not supported here; supported: {', '.join(peft_types)}"
        )
    if peft_type == "IA3":
        return _load_ia3_adapter(real, config, shapes, num_layers, dtype, allowed_dir)
    options = parse_lora_config(config)
    rank = options["r"]
    if max_rank is not None and rank > max_rank:
        raise ValueError(
            f"the adapter's rank {rank} exceeds max_lora_rank {max_rank} (--max-lora-rank)"
        )
    weights = _read_lora_weights(real, allowed_dir)
    ranks = {a.shape[0] for a, _ in weights.values()}
    if ranks != {rank}:
        raise ValueError(
            f"adapter config says r={rank} but lora_A weights have rank(s) {sorted(ranks)}"
        )
    if dtype is not None:
        weights = {k: (a.to(dtype), b.to(dtype)) for k, (a, b) in weights.items()}
    adapter = LoRAAdapter(
        rank=rank, lora_alpha=options["lora_alpha"], weights=weights,
        use_rslora=options["use_rslora"], lora_dropout=options["lora_dropout"],
        base_model_name_or_path=options["base_model_name_or_path"],
    )
    if shapes is not None and num_layers is not None:
        adapter.check_compatible(shapes, num_layers, max_rank)
    return adapter


def _read_lora_weights(path: str, allowed_dir: str | None,
                       ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    weights_path = _weights_file(path, allowed_dir)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt", device="cpu") as f:
            for key in f.keys():
                layer, target, half = _parse_key(key)
                halves.setdefault((layer, target), {})[half] = f.get_tensor(key)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read {ADAPTER_WEIGHTS_NAME}: {_reason(e)}") from e
    if not halves:
        raise ValueError(f"{ADAPTER_WEIGHTS_NAME} holds no LoRA weights")
    weights = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"layer {layer} {target} has no {missing} weight")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                "are not a rank-r pair ([r, in] and [out, r])"
            )
        weights[(layer, target)] = (a, b)
    return weights


def _parse_key(key: str) -> tuple[int, str, str]:
    match = _KEY.match(key)
    if match is None:
        if "lora_magnitude_vector" in key:
            raise ValueError(f"tensor {key!r} is a DoRA magnitude; DoRA is not supported")
        if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
            raise ValueError(
                f"tensor {key!r} adapts the embeddings or the LM head; flexserve serves LoRA on "
                f"{_SUPPORTED} only"
            )
        raise ValueError(f"unexpected tensor {key!r} in a LoRA adapter")
    layer, parent, target, half = match.groups()
    if TARGET_MODULES.get(target) != parent:
        raise ValueError(
            f"tensor {key!r} targets {parent}.{target}; flexserve serves LoRA on {_SUPPORTED} only"
        )
    return int(layer), target, half


def parse_ia3_config(config: dict[str, Any]) -> dict[str, Any]:
    """The (IA)3 options of an adapter config.

    Returns {target_modules, feedforward_modules, base_model_name_or_path}; the two module
    entries are lists, or None / a regex string (then the tensors' shapes decide).
    """
    peft_type = config.get("peft_type")
    if peft_type != "IA3":
        raise ValueError(f"peft_type {peft_type!r} is not an (IA)3 adapter")
    for key, what in _UNSUPPORTED_IA3_OPTIONS.items():
        if config.get(key):
            raise ValueError(f"adapter config: {what} is not supported")
    options: dict[str, Any] = {"base_model_name_or_path": config.get("base_model_name_or_path")}
    for key in ("target_modules", "feedforward_modules"):
        value = config.get(key)
        if isinstance(value, list):
            unknown = [t for t in value if t not in TARGET_MODULES]
            if unknown:
                raise ValueError(
                    f"unsupported (IA)3 {key} {', '.join(map(str, unknown))}; supported: "
                    f"{_SUPPORTED}"
                )
        elif value is not None and not isinstance(value, str):
            raise ValueError(f"adapter config: {key} must be a list or a string, got {value!r}")
        options[key] = value
    targets, feedforward = options["target_modules"], options["feedforward_modules"]
    if isinstance(targets, list) and isinstance(feedforward, list):
        stray = sorted(set(feedforward) - set(targets))
        if stray:
            raise ValueError(
                f"adapter config: feedforward_modules {', '.join(stray)} are not in target_modules"
            )
    return options


def _load_ia3_adapter(
    path: str,
    config: dict[str, Any],
    shapes: dict[str, tuple[int, int]] | None,
    num_layers: int | None,
    dtype: torch.dtype | None,
    allowed_dir: str | None = None,
) -> IA3Adapter:
    from safetensors import SafetensorError, safe_open

    options = parse_ia3_config(config)
    weights_path = _weights_file(path, allowed_dir)
    raw: dict[tuple[int, str], torch.Tensor] = {}
    try:
        with safe_open(weights_path, framework="pt", device="cpu") as f:
            for key in f.keys():
                match = _IA3_KEY.match(key)
                if match is None:
                    raise ValueError(f"unexpected tensor {key!r} in an (IA)3 adapter")
                layer, parent, target = match.groups()
                if TARGET_MODULES.get(target) != parent:
                    raise ValueError(
                        f"tensor {key!r} targets {parent}.{target}; flexserve supports (IA)3 on "
                        f"{_SUPPORTED} only"
                    )
                raw[(int(layer), target)] = f.get_tensor(key)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read {ADAPTER_WEIGHTS_NAME}: {_reason(e)}") from e
    if not raw:
        raise ValueError(f"{ADAPTER_WEIGHTS_NAME} holds no (IA)3 vectors")
    # PEFT stores l as [1, in] for a feed-forward module (input scaled) and [out, 1] otherwise.
    kinds: dict[str, bool] = {}
    weights = {}
    for (layer, target), tensor in sorted(raw.items()):
        if tensor.dim() != 2 or 1 not in tensor.shape or tensor.shape == (1, 1):
            raise ValueError(
                f"layer {layer} {target}: ia3_l has shape {tuple(tensor.shape)}; PEFT stores "
                "[out, 1] (output scaled) or [1, in] (feed-forward, input scaled)"
            )
        feedforward = tensor.shape[0] == 1
        if kinds.setdefault(target, feedforward) != feedforward:
            raise ValueError(f"{target} is input-scaled in some layers and output-scaled in others")
        weights[(layer, target)] = tensor.reshape(-1).to(dtype) if dtype else tensor.reshape(-1)
    declared = options["feedforward_modules"]
    feedforward_modules = tuple(t for t in TARGET_MODULES if kinds.get(t))
    if isinstance(declared, list):
        for target, feedforward in kinds.items():
            if feedforward != (target in declared):
                raise ValueError(
                    f"{target}: adapter config says it is "
                    f"{'' if target in declared else 'not '}a feed-forward module, but its "
                    f"ia3_l is stored as {'[1, in]' if feedforward else '[out, 1]'}"
                )
    adapter = IA3Adapter(weights=weights, feedforward_modules=feedforward_modules,
                         base_model_name_or_path=options["base_model_name_or_path"])
    if shapes is not None and num_layers is not None:
        adapter.check_compatible(shapes, num_layers)
    return adapter


def _weights_file(path: str, allowed_dir: str | None = None) -> str:
    weights_path = adapter_file(path, ADAPTER_WEIGHTS_NAME, allowed_dir)
    if not os.path.isfile(weights_path):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise ValueError(
                f"{ADAPTER_WEIGHTS_NAME} is missing: only safetensors adapters are "
                "supported (adapter_model.bin is a pickle, which is not loaded for safety)"
            )
        raise ValueError(f"{ADAPTER_WEIGHTS_NAME} is missing in the adapter directory")
    return weights_path


def save_peft_adapter(
    adapter: LoRAAdapter | IA3Adapter, path: str, base_model_name_or_path: str | None = None
) -> None:
    """Write `adapter` (LoRA or (IA)3) as PEFT does, loadable by `PeftModel.from_pretrained` and
    by flexserve."""
    from safetensors.torch import save_file

    if isinstance(adapter, IA3Adapter):
        _save_ia3_adapter(adapter, path, base_model_name_or_path)
        return
    if not isinstance(adapter, LoRAAdapter):
        raise ValueError(f"cannot save a {type(adapter).__name__} in the PEFT format")
    os.makedirs(path, exist_ok=True)
    base = base_model_name_or_path or adapter.base_model_name_or_path
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": adapter.rank,
        "lora_alpha": adapter.lora_alpha,
        "lora_dropout": adapter.lora_dropout,
        "use_rslora": adapter.use_rslora,
        "target_modules": list(adapter.target_modules),
        "bias": "none",
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    tensors = {}
    for (layer, target), (a, b) in sorted(adapter.weights.items()):
        prefix = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[target]}.{target}"
        tensors[f"{prefix}.lora_A.weight"] = a.detach().to("cpu").contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.detach().to("cpu").contiguous()
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def _save_ia3_adapter(adapter: IA3Adapter, path: str, base_model_name_or_path: str | None) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = {
        "peft_type": "IA3",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or adapter.base_model_name_or_path,
        "target_modules": list(adapter.target_modules),
        "feedforward_modules": list(adapter.feedforward_modules),
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_ia3_weights": True,
        "inference_mode": True,
    }
    tensors = {}
    for (layer, target), vector in sorted(adapter.weights.items()):
        key = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[target]}.{target}.ia3_l"
        shape = (1, -1) if adapter.is_feedforward(target) else (-1, 1)
        tensors[key] = vector.detach().to("cpu").reshape(shape).contiguous()
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")

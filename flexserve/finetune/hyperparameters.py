"""Hyper-parameters of a fine-tuning job: slotted dataclasses that validate themselves.

`from_dict` reads what a job request sends (JSON): it rejects unknown keys and wrong types (a bool
is not a number, 8.0 is not an integer) with a `ValueError` naming the field, and maps OpenAI's
`"auto"` to the documented default. No torch import: the engine and the API layer use this.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_BATCH_SIZE = 8
DEFAULT_LEARNING_RATE = 1e-4
DEFAULT_N_EPOCHS = 1
DEFAULT_MAX_SEQ_LEN = 2048
# Upper bounds (400 beyond them): a job's plan is built and held in memory, and its integers
# are stored in SQLite (64-bit), so nothing a request sends may be unbounded.
MAX_BATCH_SIZE = 1024
MAX_N_EPOCHS = 1000
MAX_WARMUP_STEPS = 1_000_000
MAX_SEQ_LEN = 1 << 20
MAX_SEED = 2**31 - 1  # as OpenAI's `seed`
DEFAULT_DPO_BETA = 0.1
# "supervised": mean token cross-entropy; "dpo": the DPO loss over preference pairs
# (flexserve.finetune.dpo).
METHODS = ("supervised", "dpo")
LR_SCHEDULERS = ("constant", "linear", "cosine")
# The seven projections of a Llama-family decoder layer (the keys of
# flexserve.peft.bypass.TARGET_MODULES; not imported from there because flexserve.peft imports
# torch and this module must not; a test checks that the two agree).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _check_int(name: str, value: object, minimum: int, maximum: int) -> None:
    if type(value) is not int:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _as_float(name: str, value: object, minimum: float, inclusive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if value < minimum or (value == minimum and not inclusive):
        raise ValueError(f"{name} must be {'>=' if inclusive else '>'} {minimum:g}, got {value:g}")
    return value


def _check_keys(cls: type, data: object, what: str) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be an object, got {type(data).__name__}")
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise ValueError(
            f"unknown {what} field(s): {', '.join(unknown)}; known: {', '.join(sorted(allowed))}"
        )


@dataclass(slots=True)
class LoRAHyperparameters:
    """The adapter a job trains: PEFT's LoRA with these settings (no bias, no DoRA, no rsLoRA)."""

    r: int = 16  # rank of A [r, in] and B [out, r]
    alpha: float = 32.0  # scaling = alpha / r
    dropout: float = 0.0  # dropout on the adapter's input during training, in [0, 1)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGET_MODULES))
    init_adapter: str | None = None  # PEFT directory or loaded adapter name; None: PEFT's init

    def __post_init__(self) -> None:
        _check_int("lora.r", self.r, 1, 1 << 16)
        self.alpha = _as_float("lora.alpha", self.alpha, 0.0, inclusive=False)
        self.dropout = _as_float("lora.dropout", self.dropout, 0.0, inclusive=True)
        if self.dropout >= 1.0:
            raise ValueError(f"lora.dropout must be < 1, got {self.dropout:g}")
        if isinstance(self.target_modules, str) or not isinstance(
                self.target_modules, (list, tuple)):
            raise ValueError(
                f"lora.target_modules must be a list of module names, got {self.target_modules!r}")
        if not self.target_modules:
            raise ValueError("lora.target_modules must name at least one module")
        for name in self.target_modules:
            if name not in LORA_TARGET_MODULES:
                raise ValueError(
                    f"lora.target_modules: unsupported module {name!r}; supported: "
                    f"{', '.join(LORA_TARGET_MODULES)}"
                )
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"lora.target_modules has duplicates: {list(self.target_modules)}")
        self.target_modules = list(self.target_modules)
        if self.init_adapter is not None and (
                not isinstance(self.init_adapter, str) or not self.init_adapter.strip()):
            raise ValueError(
                f"lora.init_adapter must be a non-empty path or adapter name, got "
                f"{self.init_adapter!r}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoRAHyperparameters:
        """Build from a JSON object; absent keys take the defaults, unknown keys are refused."""
        _check_keys(cls, data, "lora")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {
            "r": self.r, "alpha": self.alpha, "dropout": self.dropout,
            "target_modules": list(self.target_modules), "init_adapter": self.init_adapter,
        }


@dataclass(slots=True)
class Hyperparameters:
    """How a job trains: data order, loss batching, AdamW, the LR schedule, and its adapter."""

    batch_size: int = DEFAULT_BATCH_SIZE  # examples per optimizer step (the last may be smaller)
    learning_rate: float = DEFAULT_LEARNING_RATE  # peak LR of the schedule
    lr_scheduler: str = "linear"  # constant | linear | cosine, after warmup (transformers' shapes)
    warmup_steps: int = 0  # optimizer steps of linear warmup from 0 to learning_rate
    weight_decay: float = 0.0  # AdamW's decoupled weight decay (torch's own default is 0.01)
    max_grad_norm: float | None = 1.0  # clip the global grad norm to this; None: no clipping
    n_epochs: int = DEFAULT_N_EPOCHS  # passes over the training file
    shuffle: bool = True  # False: file order; True: a seeded permutation per epoch
    seed: int | None = None  # data order and adapter init; None: the job draws one and records it
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN  # longer examples are truncated (bounded by the model)
    lora: LoRAHyperparameters = field(default_factory=LoRAHyperparameters)
    method: str = "supervised"  # a METHODS entry: the loss the job trains
    beta: float | None = None  # DPO's beta (how far from the reference); None for supervised

    def __post_init__(self) -> None:
        _check_int("batch_size", self.batch_size, 1, MAX_BATCH_SIZE)
        self.learning_rate = _as_float("learning_rate", self.learning_rate, 0.0, inclusive=False)
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(
                f"lr_scheduler must be one of {', '.join(LR_SCHEDULERS)}, got {self.lr_scheduler!r}"
            )
        _check_int("warmup_steps", self.warmup_steps, 0, MAX_WARMUP_STEPS)
        self.weight_decay = _as_float("weight_decay", self.weight_decay, 0.0, inclusive=True)
        if self.max_grad_norm is not None:
            self.max_grad_norm = _as_float(
                "max_grad_norm", self.max_grad_norm, 0.0, inclusive=False)
        _check_int("n_epochs", self.n_epochs, 1, MAX_N_EPOCHS)
        if type(self.shuffle) is not bool:
            raise ValueError(f"shuffle must be true or false, got {self.shuffle!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        # Two tokens at least: position 0 is never predicted, so one token has nothing to learn.
        _check_int("max_seq_len", self.max_seq_len, 2, MAX_SEQ_LEN)
        if not isinstance(self.lora, LoRAHyperparameters):
            raise ValueError(f"lora must be a LoRAHyperparameters, got {type(self.lora).__name__}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "dpo":
            self.beta = DEFAULT_DPO_BETA if self.beta in (None, "auto") else _as_float(
                "beta", self.beta, 0.0, inclusive=False)
        elif self.beta is not None:
            raise ValueError("beta is a hyper-parameter of the dpo method, not of supervised "
                             "fine-tuning")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Hyperparameters:
        """Build from a job request's JSON object; absent keys take the defaults.

        OpenAI compatibility: `"auto"` for batch_size or n_epochs means the default;
        `learning_rate_multiplier` (a number or `"auto"` = 1) sets learning_rate to that multiple
        of the default and may not be combined with `learning_rate`; `"auto"` for beta (dpo only)
        means 0.1. `lora` is a nested object (see `LoRAHyperparameters.from_dict`).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"hyperparameters must be an object, got {type(data).__name__}")
        values = dict(data)
        multiplier = values.pop("learning_rate_multiplier", None)
        _check_keys(cls, values, "hyperparameters")
        for name, default in (("batch_size", DEFAULT_BATCH_SIZE), ("n_epochs", DEFAULT_N_EPOCHS)):
            if values.get(name) == "auto":
                values[name] = default
        if multiplier is not None:
            if "learning_rate" in values:
                raise ValueError("give learning_rate or learning_rate_multiplier, not both")
            if multiplier != "auto":
                factor = _as_float("learning_rate_multiplier", multiplier, 0.0, inclusive=False)
                values["learning_rate"] = factor * DEFAULT_LEARNING_RATE
        if "lora" in values:
            values["lora"] = LoRAHyperparameters.from_dict(values["lora"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that `from_dict` turns back into an equal object."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lora"}
        out["lora"] = self.lora.to_dict()
        return out

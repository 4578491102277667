"""Fine-tuning semantics: training data and loss masks, step batching, hyper-parameters, AdamW.

Everything here but `AdapterOptimizer` is pure Python, so the engine (which never imports torch)
can parse data and plan steps; `AdapterOptimizer` is imported on first use for the same reason.
docs/finetuning.md ("Training semantics") states the rules these modules implement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flexserve.finetune.chat import encode_chat
from flexserve.finetune.data import (
    DATA_FORMATS,
    TrainingData,
    TrainingExample,
    TruncationEvent,
    encode_example,
    load_training_data,
)
from flexserve.finetune.hyperparameters import Hyperparameters, LoRAHyperparameters
from flexserve.finetune.schedule import lr_at, lr_factor
from flexserve.finetune.steps import (
    TrainingStep,
    epoch_order,
    num_training_steps,
    plan_training_steps,
)

if TYPE_CHECKING:
    from flexserve.finetune.optimizer import AdapterOptimizer

__all__ = [
    "AdapterOptimizer", "DATA_FORMATS", "Hyperparameters", "LoRAHyperparameters", "TrainingData",
    "TrainingExample", "TrainingStep", "TruncationEvent", "encode_chat", "encode_example",
    "epoch_order", "load_training_data", "lr_at", "lr_factor", "num_training_steps",
    "plan_training_steps",
]


def __getattr__(name: str) -> Any:
    if name == "AdapterOptimizer":
        from flexserve.finetune.optimizer import AdapterOptimizer

        return AdapterOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""flexserve: co-serving LLM inference and token-level LoRA fine-tuning on shared GPUs.

`LLM` is imported on first use, so `import flexserve.envs` (which the kernels do) stays cheap and
never loads the engine, the worker or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flexserve.engine.lora_request import LoRARequest
from flexserve.outputs import CompletionOutput, Logprob, RequestOutput
from flexserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from flexserve.entrypoints.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
    "CompletionOutput", "Logprob",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from flexserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

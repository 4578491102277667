"""flexserve: co-serving LLM inference and token-level LoRA fine-tuning on shared GPUs."""

from flexserve.engine.lora_request import LoRARequest
from flexserve.entrypoints.llm import LLM
from flexserve.outputs import CompletionOutput, Logprob, RequestOutput
from flexserve.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
    "__version__",
]

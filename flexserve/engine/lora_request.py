"""`LoRARequest`: which adapter a request uses (vLLM's name and fields); plain Python."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter in PEFT format, selected by name.

    Inside an engine every registration gets its own `lora_int_id`, never reused: the prefix
    cache keys KV blocks by it, so an adapter unloaded and loaded again under the same name (maybe
    with new weights) can never be served KV computed with the old one. An id passed in by a caller
    of the offline API is checked for type only; the engine numbers adapters itself.
    """

    lora_name: str  # the name requests select it by (`model` in the HTTP API)
    lora_int_id: int  # positive; unique per registration within one engine
    lora_path: str  # directory holding adapter_config.json + adapter_model.safetensors

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if type(self.lora_int_id) is not int or self.lora_int_id <= 0:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty path, got {self.lora_path!r}")

"""`ModelInfo`: what the worker tells the engine about the model it loaded (part of the contract)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ModelInfo:
    """What the engine knows about the loaded model (filled by the loader side)."""

    name: str  # the name the model was asked for
    vocab_size: int  # logits width
    max_model_len: int  # resolved context length
    eos_token_id: int | None  # from the tokenizer, else the config
    num_blocks: int  # KV cache blocks allocated
    block_size: int  # tokens per block
    device: str  # e.g. "cuda:0" or "cpu"
    dtype: str  # e.g. "bfloat16"
    num_layers: int = 0  # decoder layers (fine-tuning's backward walks them top-down)
    device_name: str = ""  # e.g. "NVIDIA H200" or "cpu" (latency profiles are per device)
    num_finetune_slots: int = 0  # LoRA slots for fine-tuning jobs, numbered after max_loras
    finetune_state_bytes: int = 0  # memory for fine-tuning jobs' training state
    # (in_features, out_features) of each LoRA target module (`flexserve.peft.bypass`)
    lora_target_features: dict[str, tuple[int, int]] = field(default_factory=dict)

"""The fine-tuning reference the exactness tests compare against: HF transformers + peft +
torch.optim.AdamW over the same optimizer steps, sequence by sequence (mean token loss per step)."""

from __future__ import annotations

import torch


def train_hf_peft(model_dir, adapter_dir, examples, steps, lr, dtype) -> dict[str, torch.Tensor]:
    """The adapter after training `examples` (flexserve `TrainingExample`s) in `steps` (example
    indices per optimizer step), starting from the PEFT adapter in `adapter_dir`; fp64 copies
    keyed by parameter name without the `.default` adapter suffix."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    for step in steps:
        n = sum(sum(examples[i].loss_mask) for i in step)
        loss = 0.0
        for i in step:
            ids = torch.tensor([examples[i].input_ids])
            ce = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:],
                                                   reduction="sum")
            loss = loss + ce / n
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k.replace(".default", ""): p.detach().double()
            for k, p in model.named_parameters() if p.requires_grad}


def save_random_peft_adapter(model_dir, adapter_dir, target_modules, generator, scale) -> str:
    """A PEFT LoRA adapter (r 8, alpha 16) on `model_dir`'s `target_modules` with every A and B
    entry drawn as randn * `scale` from `generator` (non-zero B: the adapter changes the output),
    saved by peft into `adapter_dir`; returns `adapter_dir` as a str."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                LoraConfig(r=8, lora_alpha=16, target_modules=target_modules))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(adapter_dir)
    return str(adapter_dir)

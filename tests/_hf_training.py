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

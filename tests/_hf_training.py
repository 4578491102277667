"""The fine-tuning reference the exactness tests compare against: HF transformers + peft +
torch.optim.AdamW over the same optimizer steps, sequence by sequence (mean token loss per step)."""

from __future__ import annotations

import torch


def train_hf_peft(model_dir, adapter_dir, examples, steps, lr, dtype,
                  max_grad_norm: float | None = None) -> dict[str, torch.Tensor]:
    """The adapter after training `examples` (flexserve `TrainingExample`s) in `steps` (example
    indices per optimizer step), starting from the PEFT adapter in `adapter_dir`, gradients
    clipped to `max_grad_norm` when given; fp64 copies keyed by parameter name without the
    `.default` adapter suffix."""
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
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
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


def check_against_fp64(ours: dict[str, torch.Tensor], hf32: dict[str, torch.Tensor],
                       hf64: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> None:
    """The exactness bound of the training tests: flexserve's adapter change is within
    max(1e-4, the fp32 HF loop's error) of the fp64 HF loop's over all tensors, and each tensor's
    within max(1e-2, the fp32 HF loop's worst tensor's) (Adam's normalization magnifies fp32
    rounding where a gradient is near zero)."""
    keys = sorted(hf64)
    assert len(ours) == len(keys) == len(initial)
    ours_error = relative_change_error(ours, hf64, initial, keys)
    hf_error = relative_change_error(hf32, hf64, initial, keys)
    print(f"relative error of the weight change vs fp64: flexserve {ours_error:.2e}, "
          f"HF fp32 {hf_error:.2e}")
    assert ours_error <= max(1e-4, hf_error)
    worst = max(relative_change_error(ours, hf64, initial, [k]) for k in keys)
    hf_worst = max(relative_change_error(hf32, hf64, initial, [k]) for k in keys)
    assert worst <= max(1e-2, hf_worst), (
        f"worst tensor's relative error of its change {worst:.2e} (HF fp32: {hf_worst:.2e})")


def relative_change_error(weights: dict[str, torch.Tensor], truth: dict[str, torch.Tensor],
                          initial: dict[str, torch.Tensor], keys: list[str]) -> float:
    """||dW - dW_truth|| / ||dW_truth|| over the tensors `keys` (peft names, with or without the
    `.default` suffix), where dW is a trained adapter's change from `initial` (a saved adapter);
    the exactness tests' measure of a trained adapter against the fp64 reference `truth`."""
    def change(adapter: dict[str, torch.Tensor], key: str) -> torch.Tensor:
        name = key.replace(".default", "")
        return adapter.get(key, adapter.get(name)).double() - initial[name].double()

    a = torch.cat([change(weights, k).flatten() for k in keys])
    b = torch.cat([change(truth, k).flatten() for k in keys])
    return float((a - b).norm() / b.norm())


def load_saved(path: str) -> dict[str, torch.Tensor]:
    """The tensors of the PEFT adapter saved in `path`."""
    from safetensors.torch import load_file

    return load_file(f"{path}/adapter_model.safetensors")

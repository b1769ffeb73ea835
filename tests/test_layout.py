"""The import graph of tpbench obeys its layers (tpbench.LAYERS): no import cycle, no import of a
higher layer, and no source file over 500 lines. Imports inside functions count as module-level ones
do. No torch: the sources are parsed (ast), not imported."""

from __future__ import annotations

import ast
from pathlib import Path

import tpbench

PACKAGE = Path(tpbench.__file__).resolve().parent
MAX_LINES = 500


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package (a package by its __init__)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of the package that `name` imports, anywhere in its source: `import a.b`, `from a
    import b` (module a.b when b is one, else a), relative imports included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def owner(dotted: str) -> str | None:  # the module that defines `dotted`
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {owner(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            found |= {owner(f"{base}.{alias.name}") for alias in node.names}
    return found - {None, name}


def graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, set(known)) for name, path in known.items()}


def layer(module: str) -> int:
    """The index in tpbench.LAYERS of the entry holding `module` (the longest matching name)."""
    relative = module.partition(".")[2]
    matches = [
        (len(entry), i)
        for i, entries in enumerate(tpbench.LAYERS)
        for entry in entries
        if relative == entry or relative.startswith(entry + ".")
    ]
    assert matches, f"{module} is in no layer of tpbench.LAYERS: add it where it belongs"
    return max(matches)[1]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_as_python_imports(tmp_path):
    """The reader itself: every form of import, top-level or in a function, a submodule named in
    `from package import submodule`, and a name of a package's __init__."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("X = 1\n")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import leaf\nY = 2\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from .. import low\n")
    (pkg / "top.py").write_text(
        "import pkg.sub.leaf\nfrom pkg.sub import Y\n\ndef g():\n    from pkg.low import X\n"
    )
    assert graph(pkg) == {
        "pkg": set(),
        "pkg.low": set(),
        "pkg.sub": {"pkg.sub.leaf"},
        "pkg.sub.leaf": {"pkg.low"},
        "pkg.top": {"pkg.sub.leaf", "pkg.sub", "pkg.low"},
    }
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_of_a_higher_layer():
    up = [
        f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
        for module, targets in sorted(graph().items())
        for target in sorted(targets)
        if layer(target) > layer(module)
    ]
    assert not up, "imports of a higher layer:\n" + "\n".join(up)


def test_no_source_file_over_500_lines():
    over = [
        f"{path.relative_to(PACKAGE)}: {n} lines"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not over, f"files over {MAX_LINES} lines: " + ", ".join(over)


def test_every_entry_of_the_layers_names_a_module():
    """A module moved or gone leaves no entry behind that names nothing (and so holds nothing)."""
    known = modules()
    stale = [entry for entries in tpbench.LAYERS for entry in entries if f"tpbench.{entry}" not in known]
    assert not stale, f"entries of tpbench.LAYERS that name no module: {stale}"

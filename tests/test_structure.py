"""The package's shape: no import cycles, debug tools beside the API, the CLI on the wheel alone."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tessera"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every tessera module ``name`` imports, at import time or in a function, with the packages
    each import runs (importing ``a.b.c`` runs ``a/b/__init__``); the root package is left out,
    since every module runs it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            submodules = {f"{module}.{alias.name}" for alias in node.names} & modules.keys()
            targets |= submodules
            if len(submodules) < len(node.names):
                targets.add(module)
    expanded = set()
    for target in targets:
        parts = target.split(".")
        expanded.update(".".join(parts[:k]) for k in range(2, len(parts) + 1))
    return {t for t in expanded if t in modules and t != name and not name.startswith(t + ".")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph.get(name, ()))
    return seen


def test_no_two_modules_import_each_other():
    graph = _graph()
    cycles = sorted(name for name in graph if name != "tessera" and name in _reachable(graph, name))
    assert not cycles, f"modules that import themselves through others: {cycles}"


def test_debug_tools_do_not_import_the_packages_face():
    graph = _graph()
    for name in graph:
        if name.startswith("tessera.debug"):
            assert not _reachable(graph, name) & {"tessera", "tessera.api"}, name


def test_the_cli_does_not_import_the_repositorys_benchmarks():
    for path in (PACKAGE / "cli").rglob("*.py") if (PACKAGE / "cli").is_dir() else [PACKAGE / "cli.py"]:
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] == "benchmarks"], path


def test_every_module_is_small_and_the_pieces_owner_smaller():
    """A module has one job: none over 500 lines, and the owner of a model's pieces (whose every
    stage once lived in it) under 300."""
    import re

    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    # A review norm, not a rule (issue 77): a class is never split across files to fit a count.
    long = {p: n for p, n in sizes.items() if n > 500}
    if long:
        warnings.warn(f"modules over 500 lines, for review: {long}", stacklevel=1)
    owner = (PACKAGE / "split_model.py").read_text()
    body = re.search(r"^class SplitModel\b.*?(?=^\S)", owner + "\nEND", re.S | re.M)
    assert body is not None and len(body.group(0).splitlines()) < 300


def test_every_compat_definition_says_which_torch_it_was_checked_on():
    """Every function, class and UPPER_CASE constant of ``tessera/_compat/`` (private helpers too)
    names the torch versions it was checked on: ``Checked on torch ...`` in its docstring, or in a
    comment on the line directly above the constant (or on its line)."""
    missing = []
    for path in sorted((PACKAGE / "_compat").glob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.parse(text).body:
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if "Checked on torch" not in (ast.get_docstring(node) or ""):
                    missing.append(f"{where} {node.name} (docstring)")
                continue
            if not isinstance(node, (ast.Assign, ast.AnnAssign)):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = target.id if isinstance(target, ast.Name) else ""
                if name.strip("_") and name == name.upper() and any(c.isalpha() for c in name):
                    near = lines[max(node.lineno - 2, 0) : node.lineno]
                    if not any("Checked on torch" in line for line in near):
                        missing.append(f"{where} {name} (comment above)")
    assert not missing, (
        "say which torch versions each _compat definition was checked on, and why it exists "
        "('Checked on torch 2.11, 2.13: <private API>; <public replacement, if any>'): " + ", ".join(missing)
    )

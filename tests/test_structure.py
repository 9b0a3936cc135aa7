"""The package's shape: dependencies between its parts point one way.

The import graph is read from the source with :mod:`ast` (nothing is imported). A *part* is a
subpackage (``dynn_runtime.trace``) or a top-level module (``dynn_runtime.cli``); the zoo in
``models/`` is installed as ``dynn_runtime.models`` and is a part too.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "dynn_runtime"
#: source directory of each installed package root (pyproject maps models/ to dynn_runtime.models)
SOURCES = {PKG: ROOT / "dynn_runtime", f"{PKG}.models": ROOT / "models"}


@dataclass(frozen=True)
class Import:
    """One ``import``/``from ... import`` of a name of this package, as written in ``module``."""

    module: str
    """The importing module."""
    target: str
    """The module imported (for ``from X import y``: ``X.y`` when that is a module, else ``X``)."""
    names: tuple[str, ...]
    """The names taken from ``target`` (empty for ``import X``)."""
    line: int
    module_level: bool
    """Whether it runs when ``module`` is imported (not deferred into a function or a class body)."""

    def where(self) -> str:
        return f"{self.module}:{self.line}"


def _modules() -> dict[str, Path]:
    out = {}
    for prefix, src in SOURCES.items():
        for path in sorted(src.rglob("*.py")):
            parts = [prefix, *path.relative_to(src).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _walk(nodes, module_level: bool):
    """Import statements among ``nodes`` and below, each with whether it runs at import time."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, module_level
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from _walk(node.orelse, module_level)  # the body never runs
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(ast.iter_child_nodes(node), False)
        else:  # a class body, if/try/with at module level: runs when the module is imported
            yield from _walk(ast.iter_child_nodes(node), module_level)


def _imports() -> list[Import]:
    out = []
    for mod, path in MODULES.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node, module_level in _walk(ast.parse(path.read_text(), str(path)).body, True):
            if isinstance(node, ast.Import):
                targets = [(a.name, ()) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
                names = tuple(a.name for a in node.names if f"{base}.{a.name}" not in MODULES)
                targets = [(m, ()) for m in submodules] + ([(base, names)] if names else [])
            for target, names in targets:
                if target == PKG or target.startswith(PKG + "."):
                    out.append(Import(mod, target, names, node.lineno, module_level))
    return out


IMPORTS = _imports()


def part(module: str) -> str:
    """``dynn_runtime.trace.format`` -> ``trace``; the package's own ``__init__`` is ``dynn_runtime``."""
    rest = module[len(PKG) + 1:]
    return rest.split(".")[0] if rest else PKG


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    # guards the parser: a test that finds no imports would pass vacuously
    assert {"trace", "policies", "pilot", "runtime", "sim", "bench", "models", "cli"} <= {part(m) for m in MODULES}
    edges = {(part(i.module), part(i.target)) for i in IMPORTS if i.module_level}
    assert ("sim", "policies") in edges and ("pilot", "policies") in edges and ("runtime", "trace") in edges
    assert any(not i.module_level for i in IMPORTS)


def test_cycle_finder():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_parts():
    """A module-level import from one part of the package into another never closes a loop."""
    edges: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    for i in IMPORTS:
        a, b = part(i.module), part(i.target)
        if i.module_level and a != b and PKG not in (a, b):
            edges.setdefault(a, set()).add(b)
            why.setdefault((a, b), []).append(i.where())
    cycles = _cycles(edges)
    detail = [f"{a} -> {b} at {', '.join(why[a, b])}" for c in cycles for a in c for b in c if (a, b) in why]
    assert not cycles, "import cycles between parts: " + "; ".join(detail)


#: Deferred imports (inside a function) that close a loop between parts today, each with what removes
#: it. Nothing may be added here.
PENDING_DEFERRED_EDGES: dict[tuple[str, str], str] = {
    # (importing part, imported part): what must move for the edge to go
}


def test_no_import_cycle_between_parts_even_through_deferred_imports():
    """A deferred import hides a loop from the import system, not from a reader."""
    edges: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    for i in IMPORTS:
        a, b = part(i.module), part(i.target)
        if a != b and PKG not in (a, b) and (a, b) not in PENDING_DEFERRED_EDGES:
            edges.setdefault(a, set()).add(b)
            why.setdefault((a, b), []).append(i.where())
    cycles = _cycles(edges)
    detail = [f"{a} -> {b} at {', '.join(why[a, b])}" for c in cycles for a in c for b in c if (a, b) in why]
    assert not cycles, "import cycles between parts: " + "; ".join(detail)
    for (a, b), what in PENDING_DEFERRED_EDGES.items():
        found = [i for i in IMPORTS if part(i.module) == a and part(i.target) == b]
        assert found, f"{a} no longer imports {b}: drop its entry ({what})"
        assert all(not i.module_level for i in found), f"{a} -> {b} is a module-level import now"


@pytest.mark.parametrize("plugin, interface", [("pilot", "policies")])
def test_interface_does_not_import_its_plugins(plugin, interface):
    """Not even deferred: the policy interface names the pilot by module path only."""
    found = [i.where() for i in IMPORTS if part(i.module) == interface and part(i.target) == plugin]
    assert not found, f"{interface} imports {plugin} at {found}"


def test_pilot_does_not_import_the_bench():
    found = [i.where() for i in IMPORTS if part(i.module) == "pilot" and part(i.target) == "bench"]
    assert not found, f"pilot imports bench at {found} (the trace cache is in dynn_runtime.trace)"


#: Private names still imported across parts, each by a module this change could not edit, with the
#: public name of the same object it should import instead. Nothing may be added here; an entry goes
#: when its importer switches (test_pending_private_imports_are_real fails once it is stale).
PENDING_PRIVATE: dict[tuple[str, str, str], str] = {
    # (importing module, module imported from, private name): public replacement
}


def _private_imports_across_parts() -> dict[tuple[str, str, str], str]:
    out = {}
    for i in IMPORTS:
        if part(i.module) == part(i.target):
            continue
        for name in i.names:
            if name.startswith("_") and not name.startswith("__"):
                out[i.module, i.target, name] = i.where()
    return out


def test_no_private_name_imported_across_parts():
    """``from X import _name`` only within X's own part: what another part uses has a public name."""
    found = _private_imports_across_parts()
    new = {k: where for k, where in found.items() if k not in PENDING_PRIVATE}
    assert not new, "private names imported across parts: " + "; ".join(
        f"{where} imports {name} from {target}" for (_, target, name), where in sorted(new.items()))


def test_pending_private_imports_are_real():
    import importlib

    found = _private_imports_across_parts()
    for (importer, target, name), public in PENDING_PRIVATE.items():
        assert (importer, target, name) in found, f"{importer} no longer imports {name}: drop its entry"
        home = importlib.import_module(target)
        assert getattr(home, name) is getattr(home, public), f"{target}.{name} is not an alias of {public}"
        assert public in home.__all__, f"{target}.{public} is not in __all__"

"""The package's import graph: every module imports on its own, and no two nljax modules import
each other, directly or through others.

The graph is read statically with `ast`, imports inside functions included, so that an import
deferred into a function to dodge a cycle is still seen as one. An edge goes to the module an
import names: `from nljax.models import memory` is an edge to `nljax.models.memory`, `from
nljax.config import Config` one to `nljax.config`. The parent packages that Python initializes
on the way are not edges: a package `__init__` that imports its submodules would otherwise be a
cycle with each of them.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

import nljax

ROOT = Path(nljax.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, modules) -> set[str]:
    """The nljax modules `name` (at `path`) imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != name}


def graph(modules=MODULES) -> dict[str, set[str]]:
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_deferred_and_from_imports(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from p.a import f\n")
    (pkg / "a.py").write_text("def f():\n    from p import b  # deferred\n    return b\n")
    (pkg / "b.py").write_text("from p.a import f\n")
    modules = {"p": pkg / "__init__.py", "p.a": pkg / "a.py", "p.b": pkg / "b.py"}
    edges = {n: imports_of(n, p, modules) for n, p in modules.items()}
    assert edges == {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.a"}}
    assert find_cycle(edges) == ["p.a", "p.b", "p.a"]


def test_no_import_cycle_among_nljax_modules():
    edges = graph()
    assert len(edges) > 30 and edges["nljax.run.trainer"]  # the walk found the package
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports_alone(name):
    """Each module imports with no other nljax module loaded first. The modules loaded before
    are put back afterwards, so the rest of the suite keeps its classes (ConfigError, ...)."""
    saved = {k: v for k, v in sys.modules.items() if k == "nljax" or k.startswith("nljax.")}
    for k in saved:
        del sys.modules[k]
    try:
        importlib.import_module(name)
    finally:
        for k in [k for k in sys.modules if k == "nljax" or k.startswith("nljax.")]:
            del sys.modules[k]
        sys.modules.update(saved)


# The parts of the package, lowest first: a module may import from its own part and from parts
# listed before it, never from a later one. The one exception is the typed config's assembly:
# `nljax.config` (and its cross-section rules, `nljax.crosschecks`) gathers each part's config
# section, declared beside the code that reads it, and everything else imports the config.
LAYERS = ["base", "parallel", "data", "models", "engine", "runtime", "checkpoint", "measure", "run", "commands"]
# `writable`: whether a destination can be made and written (run.dir, prepare's and export's
# out=), which the data, runtime and command parts check alike
BASE = {"nljax", "nljax.errors", "nljax.version", "nljax.config", "nljax.crosschecks", "nljax.yamlread",
        "nljax.writable"}
CONFIG_ASSEMBLY = {"nljax.config", "nljax.crosschecks"}


def part_of(name: str) -> str:
    """The part a module belongs to: its sub-package, `base`, or `commands` (the other top-level
    modules: what `python -m nljax.X` runs, and their shared `cli`)."""
    if name in BASE:
        return "base"
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or name in {f"nljax.{p}" for p in LAYERS} else "commands"


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    rank = {p: i for i, p in enumerate(LAYERS)}
    return sorted(f"{a} ({part_of(a)}) imports {b} ({part_of(b)})" for a, targets in edges.items()
                  if a not in CONFIG_ASSEMBLY and a != "nljax" for b in targets
                  if rank[part_of(b)] > rank[part_of(a)])


def test_every_module_belongs_to_a_known_part():
    assert {part_of(m) for m in MODULES} == set(LAYERS)
    assert part_of("nljax.engine.step") == "engine" and part_of("nljax.train") == "commands"
    assert part_of("nljax.run") == "run" and part_of("nljax.config") == "base"


def test_imports_point_down_the_layers():
    assert upward_imports({"nljax.engine.step": {"nljax.run.core"}}) == [
        "nljax.engine.step (engine) imports nljax.run.core (run)"]
    bad = upward_imports(graph())
    assert not bad, "imports against the layering:\n" + "\n".join(bad)

"""The package's import graph: no circles, between modules or between the top-level parts, and the layers import
only downwards.

Edges are every `import moeserve...` / `from moeserve... import` in a module, at the top or inside a function (a
lazy import that only dodges a circle is still a circle), except under `if TYPE_CHECKING:` (annotations only).
A package's `__init__` counts as importing what it imports. The test reads the sources with `ast`: nothing is
imported, so it is fast and sees every branch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "moeserve"

# Plugin registration, the one allowed circle: the registry imports the architecture package so that every
# architecture module registers itself (each imports the registry to do so).
PLUGIN_REGISTRATION = {("moeserve.models.registry", "moeserve.models.archs")}

# Which top-level parts may not import which (a lower layer never reaches up).
FORBIDDEN = {
    "experts": ("bench", "engine", "models", "server", "cli"),
    "models": ("engine", "server", "cli", "bench"),
    "state": ("engine", "models", "server", "cli", "bench", "experts"),
    "formats": ("engine", "models", "server", "cli", "bench", "experts"),
    "checkpoint": ("engine", "models", "server", "cli", "bench", "experts"),
    "memory": ("engine", "server", "cli", "bench", "experts", "models"),
    "engine": ("server", "cli", "bench"),
    "server": ("cli", "bench"),
    "parallel": ("engine", "models", "server", "cli", "bench", "experts", "state", "memory"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        deps: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from moeserve.models import layers` imports the module moeserve.models.layers.base
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            deps.update(t for t in targets if t in modules and t != name and (name, t) not in PLUGIN_REGISTRATION)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path a -> ... -> a, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between top-level parts: `moeserve.experts.store -> moeserve.memory.chunks` is experts -> memory
    (a top-level module such as moeserve.config is a part of its own; the package's `__init__` is `moeserve`)."""
    def part(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    parts: dict[str, set[str]] = {}
    for module, deps in graph.items():
        parts.setdefault(part(module), set()).update(part(d) for d in deps if part(d) != part(module))
    return parts


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph()
    assert len(graph) > 50  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_two_top_level_parts_import_each_other() -> None:
    """experts -> memory -> experts is a circle even when no single module closes it (each part is imported
    whole by whoever uses it, and the layering is read between parts)."""
    graph = import_graph()
    cycle = find_cycle(part_graph(graph))
    where = [f"{a} -> {b}: " + ", ".join(sorted(f"{m} -> {d}" for m, deps in graph.items() if m.split(".")[1:2] == [a]
                                                  for d in deps if d.split(".")[1:2] == [b]))
             for a, b in zip(cycle or [], (cycle or [])[1:], strict=False)]
    assert cycle is None, "circle between parts: " + " -> ".join(cycle or []) + "\n" + "\n".join(where)


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_lower_layers_never_import_upper_ones(part: str) -> None:
    graph = import_graph()
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith(f"moeserve.{part}.") or m == f"moeserve.{part}"
                 for d in deps if d.split(".")[1] in FORBIDDEN[part])
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_circle_and_a_lazy_import() -> None:
    """The test can fail: a made-up graph with a circle through a function-level import is caught."""
    tree = ast.parse("def f():\n    from moeserve.b import x\n")
    assert isinstance(tree.body[0], ast.FunctionDef)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_checker_sees_a_circle_between_parts_that_no_module_closes() -> None:
    """The test can fail: experts.tiers -> memory.chunks and memory.probes -> experts.transfer make no module
    circle, but a circle between the parts experts and memory, which the part graph shows."""
    graph = {"moeserve.experts.tiers": {"moeserve.memory.chunks"}, "moeserve.experts.transfer": set(),
             "moeserve.memory.chunks": set(), "moeserve.memory.probes": {"moeserve.experts.transfer"},
             "moeserve.config": set()}
    assert find_cycle(graph) is None
    assert part_graph(graph) == {"experts": {"memory"}, "memory": {"experts"}, "config": set()}
    assert find_cycle(part_graph(graph)) == ["experts", "memory", "experts"]

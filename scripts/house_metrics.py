"""Figures of the house: how readable the tree is, measured the same way before and after a change.

    python scripts/house_metrics.py [ROOT]            # one tree (default: this checkout)
    python scripts/house_metrics.py --rev REV         # a commit, read from git without checking it out

Prints one line per figure: README words and lines, docs lines under dated headings (a heading naming a date,
an issue, a session, a pass or a round: history that belongs in git), package files over 500 lines, functions
over 60 lines, classes over 20 methods, module globals rewritten after import (`global` statements), import
cycles in the package (strongly connected groups of modules, and of top-level subpackages), scripts (scripts/ and
research/) that patch `sys.path` or import from `tests`. Reads files only (ast), imports nothing of the package.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

DATED = re.compile(r"20\d\d-\d\d-\d\d|\bissue\b|\bsession\b|\bpass\b|\bround\b|\bhelper\b|\bH\d\b", re.I)
HEADING = re.compile(r"^(#{1,6})\s")


class Tree:
    """Files of a checkout folder or of a git commit, read as text."""

    def __init__(self, root: Path, rev: str | None) -> None:
        self.root, self.rev = root, rev

    def files(self, folder: str, suffix: str) -> Iterator[str]:
        if self.rev is None:
            base = self.root / folder
            yield from sorted(str(p.relative_to(self.root)) for p in base.rglob(f"*{suffix}") if p.is_file())
            return
        out = subprocess.run(["git", "-C", str(self.root), "ls-tree", "-r", "--name-only", self.rev, folder],
                             capture_output=True, text=True, check=True).stdout
        yield from sorted(p for p in out.splitlines() if p.endswith(suffix))

    def read(self, path: str) -> str:
        if self.rev is None:
            return (self.root / path).read_text(encoding="utf-8", errors="replace")
        return subprocess.run(["git", "-C", str(self.root), "show", f"{self.rev}:{path}"],
                              capture_output=True, text=True, check=True).stdout


def dated_lines(text: str) -> int:
    """Lines under a dated heading, up to the next heading of the same or a higher level."""
    count, dated_level = 0, 0
    for line in text.splitlines():
        m = HEADING.match(line)
        if m:
            level = len(m.group(1))
            if dated_level and level <= dated_level:
                dated_level = 0
            if not dated_level and DATED.search(line):
                dated_level = level
        if dated_level:
            count += 1
    return count


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _module_name(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(sources: dict[str, ast.Module]) -> dict[str, set[str]]:
    """module -> modules of the package it imports (function-level imports too; TYPE_CHECKING blocks not)."""
    names = {_module_name(p) for p in sources}
    graph: dict[str, set[str]] = {}
    for path, tree in sources.items():
        skip: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for child in node.body:
                    skip.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
        deps: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    target = full if full in names else node.module
                    if target in names:
                        deps.add(target)
        name = _module_name(path)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph between top-level subpackages (moeserve.experts, moeserve.memory, ...)."""
    def top(m: str) -> str:
        return ".".join(m.split(".")[:2])
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(top(m), set()).update(top(d) for d in deps if top(d) != top(m))
    return out


def patches_sys_path(path: str, text: str) -> bool:
    """Whether a script changes sys.path: a Python script calls sys.path.insert/append/extend or assigns to
    sys.path (read from its ast, so a mention in a string or comment does not count); a shell script names it."""
    if not path.endswith(".py"):
        return "sys.path" in text

    def is_sys_path(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value)
                and node.func.attr in ("insert", "append", "extend")):
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign) else []
        if any(is_sys_path(t.value if isinstance(t, ast.Subscript) else t) for t in targets):
            return True
    return False


def measure(t: Tree) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    readme = t.read("README.md")
    rows.append(("README.md lines / words / KB", f"{len(readme.splitlines())} / {len(readme.split())} / "
                 f"{len(readme.encode()) / 1024:.1f}"))
    docs = list(t.files("docs", ".md"))
    doc_lines = sum(len(t.read(p).splitlines()) for p in docs)
    rows.append(("docs: files / lines / lines under dated headings",
                 f"{len(docs)} / {doc_lines} / {sum(dated_lines(t.read(p)) for p in docs)}"))
    sources = {p: ast.parse(t.read(p)) for p in t.files("moeserve", ".py")}
    lines = {p: len(t.read(p).splitlines()) for p in sources}
    big = sorted((n, p) for p, n in lines.items() if n > 500)
    rows.append(("package: modules / lines", f"{len(sources)} / {sum(lines.values())}"))
    rows.append(("files > 500 lines", f"{len(big)} " + " ".join(f"{p}:{n}" for n, p in big)))
    long_fns = sorted(((f.end_lineno or f.lineno) - f.lineno + 1, f"{p}:{f.name}")
                      for p, tree in sources.items() for f in _functions(tree)
                      if (f.end_lineno or f.lineno) - f.lineno + 1 > 60)
    rows.append(("functions > 60 lines", f"{len(long_fns)} " + " ".join(f"{n}:{k}" for k, n in long_fns)))
    fat = sorted((sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in c.body), f"{p}:{c.name}")
                 for p, tree in sources.items() for c in ast.walk(tree) if isinstance(c, ast.ClassDef))
    fat = [(n, k) for n, k in fat if n > 20]
    rows.append(("classes > 20 methods", f"{len(fat)} " + " ".join(f"{k}:{n}" for n, k in fat)))
    globs = sorted(f"{p}:{', '.join(g.names)}" for p, tree in sources.items() for g in ast.walk(tree)
                   if isinstance(g, ast.Global))
    rows.append(("module globals rewritten after import (global statements)", f"{len(globs)} " + " ".join(globs)))
    graph = import_graph(sources)
    mod_cycles = cycles(graph)
    rows.append(("import cycles between modules (registry plugin included)",
                 f"{len(mod_cycles)} " + " | ".join(" ".join(c) for c in mod_cycles)))
    pkg_cycles = cycles(package_graph(graph))
    rows.append(("import cycles between subpackages", f"{len(pkg_cycles)} " + " | ".join(" ".join(c) for c in pkg_cycles)))
    script_files = [p for folder in ("scripts", "research") for ext in (".py", ".sh") for p in t.files(folder, ext)]
    patch = [p for p in script_files if patches_sys_path(p, t.read(p))]
    from_tests = [p for p in script_files if re.search(r"^\s*(from|import) tests\b", t.read(p), re.M)]
    rows.append(("scripts / lines", f"{len(script_files)} / {sum(len(t.read(p).splitlines()) for p in script_files)}"))
    rows.append(("scripts patching sys.path", f"{len(patch)}"))
    rows.append(("scripts importing from tests", f"{len(from_tests)}"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--rev", default=None, help="a git commit of ROOT to read instead of the files on disk")
    args = ap.parse_args()
    tree = Tree(Path(args.root), args.rev)
    print(f"# {args.root}" + (f" at {args.rev}" if args.rev else " (working tree)"))
    for name, value in measure(tree):
        print(f"{name}: {value}")


if __name__ == "__main__":
    main()

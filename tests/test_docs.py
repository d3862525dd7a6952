"""The docs cite the code as it is: every path named in README.md and docs/**/*.md exists, every `module:function`
resolves, every relative link lands on a file, and no page points at the development machine.

Paths are found as tokens starting with a top-level folder (`moeserve/`, `scripts/`, `research/`, `tests/`, `docs/`),
`csrc/` (the C++ sources under moeserve/kernels/csrc/), or a moeserve subpackage when the token ends in .py/.cpp/.h
(`experts/store.py`), and as a C++ file named alone in backticks (`norm.cpp`: one of moeserve/kernels/csrc/). A
path may also be relative to the citing page's folder. A glob (`tests/models/test_decode_stack*.py`) must match something. Function references are
`moeserve.pkg.module:Name.attr` (or fully dotted, `moeserve.pkg.module.Name`), resolved by parsing the module's
source (no imports: the check stays fast and needs no torch). docs/architecture.md's numbered walks must name a
function in every step. The last tests feed the checkers made-up text: each must report what is wrong.
"""

from __future__ import annotations

import ast
import functools
import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
ARCHITECTURE = ROOT / "docs" / "architecture.md"
WALKS = ("## A request, step by step", "## Start-up, step by step")

ROOTS = ("moeserve", "scripts", "research", "tests", "docs", "csrc")
SUBPACKAGES = ("checkpoint", "formats", "models", "state", "kernels", "experts", "memory", "engine", "server", "cli",
               "bench")
# a path token: not preceded by a character that would make it part of a longer path, URL or variable
_PATH = re.compile(r"(?<![\w./~$@:-])((?:" + "|".join(ROOTS) + r")/[\w./*-]*)")
_SHORT = re.compile(r"(?<![\w./~$@:-])((?:" + "|".join(SUBPACKAGES) + r")/[\w/-]+\.(?:py|cpp|h))\b")
_CSRC = re.compile(r"`(\w+\.(?:cpp|h))`")  # a C++ source named alone: one of moeserve/kernels/csrc/
_REF = re.compile(r"(?<![\w.])(moeserve(?:\.\w+)+(?::[\w.]+)?)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FORBIDDEN = ("../shared", "/work/", "/root/")
NOT_SOURCES = ("llama.cpp",)  # names that look like a C++ source and are not one of ours
MODULE_DUNDERS = ("__file__", "__name__", "__path__", "__doc__", "__version__")


def _resolve_path(token: str, page_dir: Path = ROOT) -> list[Path]:
    """The files a cited path names, from the repository root or from the citing page's folder (several for a
    glob; none when it names nothing)."""
    token = token.rstrip(".,:;")
    if token.startswith("csrc/"):
        token = "moeserve/kernels/" + token
    elif token.split("/")[0] in SUBPACKAGES:
        token = "moeserve/" + token
    for base in dict.fromkeys((ROOT, page_dir)):
        found = [Path(p) for p in glob.glob(str(base / token))] if "*" in token else [base / token]
        found = [p for p in found if p.exists()]
        if found:
            return found
    return []


def cited_paths(text: str) -> list[str]:
    """Every repository path the text names."""
    return [m.rstrip(".,:;") for m in _PATH.findall(text) + _SHORT.findall(text)] + [
        "csrc/" + name for name in _CSRC.findall(text) if name not in NOT_SOURCES]


def missing_paths(text: str, page_dir: Path = ROOT) -> list[str]:
    return [p for p in cited_paths(text) if not _resolve_path(p, page_dir)]


@functools.cache
def _module_tree(dotted: str) -> ast.Module | None:
    base = ROOT.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return ast.parse(path.read_text(), str(path))
    return None


def _find(body: list[ast.stmt], name: str) -> ast.AST | str | None:
    """The definition of `name` in a module or class body: a def or class node, the absolute module an imported
    name comes from (as 'module.name'), or 'assigned' for a plain assignment."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return "assigned"
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return "assigned"
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return f"{node.module}.{alias.name}"
        if isinstance(node, (ast.If, ast.Try)):  # definitions under `if TYPE_CHECKING:` / try-except imports
            found = _find(node.body, name)
            if found is not None:
                return found
    return None


def resolves(ref: str) -> bool:
    """Whether `moeserve.pkg.module:Name.attr` (or `moeserve.pkg.module.Name.attr`) names something that exists."""
    module, _, qualname = ref.partition(":")
    parts = module.split(".")
    names = qualname.split(".") if qualname else []
    # the longest prefix that is a module; the rest are names inside it
    while parts and _module_tree(".".join(parts)) is None:
        names.insert(0, parts.pop())
    if not parts:
        return False
    tree = _module_tree(".".join(parts))
    assert tree is not None
    body: list[ast.stmt] = tree.body
    for i, name in enumerate(names):
        if i == 0 and name in MODULE_DUNDERS:
            return i == len(names) - 1
        found = _find(body, name)
        if found is None:
            return False
        if isinstance(found, str):
            if found == "assigned":
                return i == len(names) - 1
            rest = ".".join(names[i + 1 :])
            return resolves(found + (f".{rest}" if rest else ""))
        if isinstance(found, ast.ClassDef):
            body = found.body
        elif i < len(names) - 1:  # a function has no named members to look into
            return False
    return True


def function_refs(text: str) -> list[str]:
    return [m.rstrip(".") for m in _REF.findall(text)]


def unresolved_refs(text: str) -> list[str]:
    return [ref for ref in function_refs(text) if not resolves(ref)]


def forbidden(text: str) -> list[str]:
    return [s for s in FORBIDDEN if s in text]


def broken_links(text: str, page: Path) -> list[str]:
    """Relative markdown links of `page` that land on no file or folder."""
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, mailto:, or an anchor on this page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    return broken


def walk_steps(text: str, heading: str) -> list[str]:
    """The numbered steps of the section under `heading` (each with its continuation lines)."""
    section = text.split(heading, 1)[1] if heading in text else ""
    section = re.split(r"\n## ", section, maxsplit=1)[0]
    steps: list[str] = []
    for line in section.splitlines():
        if re.match(r"\d+\. ", line):
            steps.append(line)
        elif steps and line.startswith(" ") and line.strip():
            steps[-1] += " " + line.strip()
        elif steps and not line.strip():
            steps.append("")  # a blank line ends a step
    return [s for s in steps if s]


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def test_there_are_docs_to_check() -> None:
    assert ARCHITECTURE in DOCS and len(DOCS) >= 10


@pytest.mark.parametrize("page", DOCS, ids=_ids(DOCS))
def test_every_cited_path_exists(page: Path) -> None:
    assert missing_paths(page.read_text(), page.parent) == []


@pytest.mark.parametrize("page", DOCS, ids=_ids(DOCS))
def test_every_named_function_resolves(page: Path) -> None:
    assert unresolved_refs(page.read_text()) == []


@pytest.mark.parametrize("page", DOCS, ids=_ids(DOCS))
def test_no_path_of_the_development_machine(page: Path) -> None:
    assert forbidden(page.read_text()) == []


@pytest.mark.parametrize("page", DOCS, ids=_ids(DOCS))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page.read_text(), page) == []


@pytest.mark.parametrize("heading", WALKS)
def test_every_step_of_the_architecture_walks_names_a_function(heading: str) -> None:
    steps = walk_steps(ARCHITECTURE.read_text(), heading)
    assert len(steps) >= 5, f"{heading}: {len(steps)} numbered steps"
    for step in steps:
        assert function_refs(step), f"{heading}: a step names no module:function: {step[:100]}"


# ------------------------------------------------------------------------------------------ negative controls
def test_a_made_up_path_is_reported() -> None:
    text = ("See `moeserve/experts/store.py`, `experts/no_such_file.py`, `scripts/no_such_script.py`, "
            "`csrc/no_such_op.cpp`, `tests/models/test_no_such*.py`, `norm.cpp` and `no_such_kernel.cpp`.")
    assert missing_paths(text) == ["scripts/no_such_script.py", "csrc/no_such_op.cpp", "tests/models/test_no_such*.py",
                                   "experts/no_such_file.py", "csrc/no_such_kernel.cpp"]


def test_a_made_up_function_is_reported() -> None:
    text = ("`moeserve.engine.llm_engine:LLMEngine.step` runs `moeserve.engine.llm_engine:LLMEngine.no_such_step`, "
            "`moeserve.engine.no_such_module:run` and `moeserve.experts.store.ExpertStore.experts`.")
    assert unresolved_refs(text) == ["moeserve.engine.llm_engine:LLMEngine.no_such_step",
                                     "moeserve.engine.no_such_module:run"]


def test_a_development_machine_path_is_reported() -> None:
    assert forbidden("the trace in /work/shared/traces, or ../shared/x, or /root/.cache") == list(FORBIDDEN)


def test_a_broken_link_is_reported() -> None:
    page = ROOT / "docs" / "architecture.md"
    text = "[ok](design/policies.md#the-policies) [bad](design/no-such-page.md) [web](https://example.com) [a](#x)"
    assert broken_links(text, page) == ["design/no-such-page.md"]


def test_a_walk_step_without_a_function_is_found() -> None:
    text = "## A request, step by step\n\n1. `moeserve.engine.llm_engine:LLMEngine.step` steps.\n2. Then magic.\n"
    steps = walk_steps(text, "## A request, step by step")
    assert [bool(function_refs(s)) for s in steps] == [True, False]

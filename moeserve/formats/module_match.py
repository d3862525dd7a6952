"""Module-name matching rules, one per checkpoint producer, for "which modules are (not) quantized".

Each producer writes its lists with its own pattern language; a `ModuleMatcher` applies that language:
- ``transformers`` (``modules_to_not_convert`` of gpt-oss ``mxfp4`` and ``fp8``): a regex matched from the
  start of the name up to a module boundary (``layers.1`` matches ``layers.1.attn``, not ``layers.11``), or
  a plain suffix (``lm_head`` matches ``model.lm_head``);
- ``compressed-tensors`` (``ignore``, ``targets``): ``re:<regex>`` matched from the start, otherwise the exact
  name; the class target ``Linear`` matches every Linear (callers only ask about Linears);
- ``fnmatch`` (ModelOpt ``exclude_modules``): shell wildcards matched against the name or any ancestor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

MatchStyle = Literal["transformers", "compressed-tensors", "fnmatch"]

_CT_REGEX_PREFIX = "re:"
_CT_LINEAR_CLASSES = ("Linear",)  # class-name targets; a module asked about is always a Linear here


@dataclass(frozen=True)
class ModuleMatcher:
    """A frozen list of patterns in one producer's pattern language."""

    style: MatchStyle
    patterns: tuple[str, ...] = ()

    def matches(self, module_name: str) -> bool:
        """Return True if any pattern matches ``module_name`` (e.g. ``model.layers.0.self_attn.q_proj``)."""
        return any(_MATCHERS[self.style](module_name, pattern) for pattern in self.patterns)


def _transformers_match(name: str, pattern: str) -> bool:
    boundary = r"(?:(?<=\.)|(?=\.|$))"  # the match ends at a dot or at the end of the name
    try:
        if re.match(rf"(?:{pattern}){boundary}", name):
            return True
    except re.error:
        pass  # not a valid regex: only the suffix rule applies
    return name.endswith(pattern)


def _compressed_tensors_match(name: str, pattern: str) -> bool:
    if pattern.startswith(_CT_REGEX_PREFIX):
        return re.match(pattern.removeprefix(_CT_REGEX_PREFIX), name) is not None
    return pattern == name or pattern in _CT_LINEAR_CLASSES


def _fnmatch_match(name: str, pattern: str) -> bool:
    parts = name.split(".")
    # "a.b.c" and its ancestors "a.b", "a": excluding a block excludes the Linears inside it.
    return any(fnmatchcase(".".join(parts[:depth]), pattern) for depth in range(len(parts), 0, -1))


_MATCHERS = {
    "transformers": _transformers_match,
    "compressed-tensors": _compressed_tensors_match,
    "fnmatch": _fnmatch_match,
}

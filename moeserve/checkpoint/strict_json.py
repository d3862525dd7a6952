"""JSON as a checkpoint must hold it: one value per key, finite numbers, nesting the parser can handle.

Python's `json` keeps the LAST of repeated keys (a safetensors header naming one tensor twice would silently
read the second one), accepts NaN and Infinity (not JSON, but Python writes them: a `rope_theta: Infinity`
would be used as is), and stops with RecursionError on deep nesting. `loads` turns each into a `ValueError`
that says what is wrong, so each caller adds the file name and raises its one-line error.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key '{key}' appears more than once")
        out[key] = value
    return out


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 overflows to infinity
        raise ValueError(f"the number {text[:40]} is not finite")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is not a number JSON allows (numbers must be finite)")


def loads(text: str | bytes) -> Any:
    """Parse `text`; ValueError with the reason on invalid JSON, a repeated key in an object, NaN or Infinity
    (or a number too large for a float), or nesting deeper than the interpreter's recursion limit. Bytes must
    be UTF-8 (UnicodeDecodeError is a ValueError too)."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_float=_finite_float,
                          parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None

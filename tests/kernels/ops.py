"""Shared helper of the kernel tests: the loaded `torch.ops.moeserve` namespace, or a skip saying why not.

`lazy_ops()` is for a module's `ops = ...` line: it loads (and, when the sources changed, builds) the kernels at the
first op a test calls, not when pytest imports the module to collect it (a build takes minutes).
"""

from __future__ import annotations

import pytest
import torch

from moeserve import kernels


def cpp_ops():  # noqa: ANN201 - torch.ops namespace
    status = kernels.load()
    if not status.available:
        pytest.skip(f"moeserve C++ kernels not available: {status.reason}")
    return torch.ops.moeserve


class _LazyOps:
    """`torch.ops.moeserve`, loaded at the first attribute asked for (inside a test: a skip skips that test)."""

    def __getattr__(self, name: str):  # noqa: ANN204 - an op of torch.ops.moeserve
        if name.startswith("_"):  # pytest's collection asks objects for _pytestfixturefunction and the like
            raise AttributeError(name)
        return getattr(cpp_ops(), name)


def lazy_ops() -> _LazyOps:
    return _LazyOps()

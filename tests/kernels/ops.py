"""Shared helper of the kernel tests: the loaded `torch.ops.moeserve` namespace, or a skip saying why not.

`lazy_ops()` is for a module's `ops = ...` line: it loads (and, when the sources changed, builds) the kernels at the
first op a test calls, not when pytest imports the module to collect it (a build takes minutes).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from moeserve import kernels


def suite_isa() -> str:
    """The ISA level of the library this test run loads: the one its engines use (MOESERVE_CPU_ISA, else auto =
    native). One library per process: a test that loaded another would make every later engine of the run refuse
    the C++ kernels (tests/cpu_emulation runs the suite with MOESERVE_CPU_ISA=avx2)."""
    return kernels.isa_level(os.environ.get("MOESERVE_CPU_ISA") or "auto")


def cpp_ops():  # noqa: ANN201 - torch.ops namespace
    status = kernels.load(suite_isa())
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


def isa_subprocess_main(argv: list[str], sources: tuple[str, ...], run: Callable[[Any], Any]) -> int:
    """The subprocess side of a cross-ISA test: argv = (isa, inputs file, outputs file); build and load the `isa`
    library of `sources` (kernels.build_subset), save `run(the saved cases)`. Exit 3: not available (no compiler, a
    failed build, a CPU that cannot run `isa`: as kernels.load)."""
    isa, inputs, outputs = argv
    try:
        library = kernels.build_subset(sources, isa)
    except RuntimeError as err:
        print(f"isa={isa} kernels not available: {err}")
        return 3
    torch.ops.load_library(str(library))
    torch.save(run(torch.load(inputs)), outputs)
    return 0

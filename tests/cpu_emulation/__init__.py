"""`TESTS_EMULATE_CPU=avx2`: the suite run on a wider x86 CPU as on an AVX2-only one (AVX2 + FMA + F16C, no AVX-512:
the AMD EPYC Zen 3 of one CI machine, most desktops and laptops), to see there what such a CI takes and fails.

What it changes, in the pytest process and (through the environment) in every Python subprocess a test starts:
- our kernels: `MOESERVE_CPU_ISA=avx2` (unless set), so every engine a test builds, subprocesses included, runs the
  avx2 library (-march=x86-64-v3); the kernel tests load that library too (tests/kernels/ops.py `test_isa`);
- torch's vectorised CPU kernels: `ATEN_CPU_CAPABILITY=avx2` (checked: ATen reads it at its first op, so it must be
  set before; `make test-as-avx2` does);
- torch's oneDNN off (`torch.backends.mkldnn.enabled = False`): an AVX2 CPU has no oneDNN bf16, so bf16 F.linear
  takes ATen's plain path there (16 rows: 133 ms vs 9 ms on this EPYC with oneDNN). Subprocesses get it from this
  folder's sitecustomize.py, put first on PYTHONPATH (a test that sets PYTHONPATH for its child adds to it:
  `child_pythonpath`).
What it cannot change: what the CPU reports (/proc/cpuinfo, torch's cpuinfo), so a test that reads the CPU's flags
still sees this one's; and a process that calls `kernels.load()` itself (`moeserve build-kernels`, the benchmarks'
kernel_setup) builds the native library beside the avx2 one (one more build than on a real AVX2 CPU).
The name is not MOESERVE_*: moeserve refuses unknown MOESERVE_* variables.
"""

from __future__ import annotations

import os
from pathlib import Path

VARIABLE = "TESTS_EMULATE_CPU"
SITE = Path(__file__).resolve().parent / "site"


def child_pythonpath(first: Path) -> str:
    """PYTHONPATH for a child process that must import from `first` (the repository): `first`, then this process's
    PYTHONPATH (where the emulation's sitecustomize is, when it is on)."""
    return os.pathsep.join(filter(None, [str(first), os.environ.get("PYTHONPATH")]))


def emulated() -> str | None:
    """The emulated CPU ("avx2"), or None; any other value is an error (a misspelt switch must not run natively)."""
    value = os.environ.get(VARIABLE)
    if value in (None, ""):
        return None
    if value != "avx2":
        raise ValueError(f"{VARIABLE}={value!r}: the one CPU the suite can emulate is 'avx2'")
    return value


def apply() -> str | None:
    """Turn the emulation on in this process and its children, where asked; returns a line for the run's header."""
    if emulated() is None:
        return None
    import torch

    os.environ.setdefault("MOESERVE_CPU_ISA", "avx2")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))
    torch.backends.mkldnn.enabled = False
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        raise RuntimeError(f"{VARIABLE}=avx2 needs ATEN_CPU_CAPABILITY=avx2 set before pytest starts (torch chose "
                           f"{capability} at its first op): run `make test-as-avx2`")
    return (f"{VARIABLE}=avx2: MOESERVE_CPU_ISA={os.environ['MOESERVE_CPU_ISA']}, ATen capability {capability}, "
            "oneDNN off (here and in subprocesses)")

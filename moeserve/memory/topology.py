"""Where the fast tier lives and whether host and device memory are one physical pool.

On unified memory (NVIDIA GB10 / DGX Spark, Jetson Orin / Thor, AMD APUs) the "GPU memory" and the "host RAM" are
the same DRAM: budgeting them separately would count every byte twice (GPU memory budgeted AND 90% of RAM pinned
for a host tier) and is how a 128 GB box gets OOM-killed by its own server. One bit (`is_integrated`) is not
trusted alone; `unified_memory=auto` calls the memory unified on any of three pieces of evidence:

1. the device reports `is_integrated`;
2. its name is a known integrated device (`KNOWN_INTEGRATED`);
3. its total memory is close to the host's MemTotal (`CLOSE_TO_MEMTOTAL`): a discrete card the size of the RAM
   would be taken for unified too, which costs the host tier but never over-commits memory (the fast tier is then
   sized from the smaller of the two free figures) — `unified_memory=off` says otherwise.

`unified_memory=on|off` overrides the detection. The decision and every piece of evidence are one start-up line.
Everything read about the machine comes in one `Machine` (tests build one by hand; `read_machine` is the real one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from moeserve.memory.cgroup import CgroupMemory, read_cgroup_memory

GiB = 1024**3

# (what the evidence line calls it, a pattern of the device name)
KNOWN_INTEGRATED: tuple[tuple[str, str], ...] = (
    ("GB10 / DGX Spark", r"\bGB10\b|DGX Spark"),
    ("Jetson", r"Jetson|\bOrin\b|\bThor\b|Xavier|Tegra"),
    ("AMD APU", r"Radeon (\d{3,4}[MS]|Graphics)\b|Radeon \d{3,4}[MS] Graphics|MI300A"),
)
# Device memory within this ratio of MemTotal: the device reports the system's DRAM as its own (GB10: 121.7 GiB
# of 121.7; Jetson: MemTotal). A discrete card is rarely within 10% below to 5% above the RAM of its host.
CLOSE_TO_MEMTOTAL = (0.90, 1.05)


@dataclass(frozen=True)
class Machine:
    """What tier sizing reads about this machine, once (`read_machine`; tests build one by hand)."""

    host_total_bytes: int  # MemTotal
    host_free_bytes: int  # MemAvailable: what the OS could give us now
    gpu: Any = None  # CUDA device properties (torch's, or a fake: name, is_integrated, total_memory); None on CPU
    gpu_free_bytes: int | None = None  # free device memory now (cudaMemGetInfo)
    host_note: str = ""  # where the host figures came from, when not plainly /proc/meminfo (a cgroup limit)


@dataclass(frozen=True)
class MemoryTopology:
    device_type: str  # "cpu" or "cuda"
    unified: bool  # host and device share one physical pool: one budget
    fast_free_bytes: int  # free memory of the fast tier now (device memory, or RAM)
    host_free_bytes: int  # free host RAM now (the same pool when unified)
    host_total_bytes: int  # MemTotal
    reason: str  # the start-up line: the decision and its evidence


def read_machine(device: torch.device) -> Machine:
    """The real machine: psutil for RAM within the process's cgroup limit, CUDA queries for a CUDA `device`."""
    vm = psutil.virtual_memory()
    total, free, note = host_memory(int(vm.total), int(vm.available), read_cgroup_memory())
    if device.type != "cuda":
        return Machine(total, free, host_note=note)
    props = torch.cuda.get_device_properties(device)  # pragma: no cover - needs a CUDA device
    gpu_free = int(torch.cuda.mem_get_info(device)[0])  # pragma: no cover
    return Machine(total, free, props, gpu_free, note)  # pragma: no cover


def host_memory(mem_total: int, mem_available: int, cgroup: CgroupMemory | None) -> tuple[int, int, str]:
    """(total, available, note) of host RAM: /proc/meminfo's figures, capped by a cgroup limit where one binds
    (a container is killed at its limit, not at MemAvailable); the note says so for the start-up line."""
    if cgroup is None or (cgroup.limit_bytes >= mem_total and cgroup.available_bytes >= mem_available):
        return mem_total, mem_available, ""
    total, free = min(mem_total, cgroup.limit_bytes), min(mem_available, cgroup.available_bytes)
    return total, free, (f"RAM within the cgroup limit {cgroup.limit_bytes / GiB:.1f} GiB ({cgroup.where}): "
                         f"{free / GiB:.1f} GiB available ({cgroup.used_bytes / GiB:.1f} GiB in use there; "
                         f"host MemAvailable {mem_available / GiB:.1f} GiB)")


def known_integrated(name: str) -> str | None:
    """The KNOWN_INTEGRATED family `name` belongs to, or None."""
    for family, pattern in KNOWN_INTEGRATED:
        if re.search(pattern, name, re.IGNORECASE):
            return family
    return None


def unified_evidence(gpu: Any, host_total_bytes: int) -> tuple[bool, str]:
    """(unified by the evidence, the evidence in words). `gpu`: name, is_integrated, total_memory."""
    name = str(getattr(gpu, "name", "?"))
    integrated = bool(getattr(gpu, "is_integrated", False))
    family = known_integrated(name)
    total = int(getattr(gpu, "total_memory", 0) or 0)
    ratio = total / host_total_bytes if host_total_bytes > 0 else 0.0
    close = CLOSE_TO_MEMTOTAL[0] <= ratio <= CLOSE_TO_MEMTOTAL[1]
    words = [f"is_integrated={int(integrated)}",
             f"a known integrated device ({family})" if family else "not a known integrated device",
             f"device memory {total / GiB:.1f} GiB = {ratio:.0%} of MemTotal {host_total_bytes / GiB:.1f} GiB"
             + (" (close)" if close else "")]
    return integrated or family is not None or close, "; ".join(words)


def decide_unified(setting: str, gpu: Any, host_total_bytes: int) -> tuple[bool, str]:
    """(unified, why) for unified_memory = auto | on | off. Pure: `gpu` may be any object with the properties."""
    detected, evidence = unified_evidence(gpu, host_total_bytes)
    if setting == "auto":
        return detected, f"auto: {evidence}"
    if setting not in ("on", "off"):
        raise ValueError(f"unified_memory must be auto, on or off, got {setting!r}")
    unified = setting == "on"
    agree = "as detected" if unified == detected else f"detection said {'unified' if detected else 'discrete'}"
    return unified, f"unified_memory={setting}, set; {agree}: {evidence}"


def detect_topology(device: torch.device, unified_memory: str = "auto", machine: Machine | None = None
                    ) -> MemoryTopology:
    """Describe the memory behind `device` (`machine`: what was read about it; default `read_machine`)."""
    m = read_machine(device) if machine is None else machine
    if device.type != "cuda":
        note = "" if unified_memory == "auto" else f" (unified_memory={unified_memory} has no effect on CPU)"
        return MemoryTopology("cpu", False, m.host_free_bytes, m.host_free_bytes, m.host_total_bytes,
                              f"CPU: the fast tier is RAM, the slow tier disk{note}{_host_note(m)}")
    name = getattr(m.gpu, "name", "?")
    unified, why = decide_unified(unified_memory, m.gpu, m.host_total_bytes)
    gpu_free = m.gpu_free_bytes if m.gpu_free_bytes is not None else m.host_free_bytes
    if unified:
        fast = _unified_free(m)
        return MemoryTopology("cuda", True, fast, m.host_free_bytes, m.host_total_bytes,
                              f"{name}: unified memory, one budget, no host tier ({why}){_host_note(m)}")
    return MemoryTopology("cuda", False, gpu_free, m.host_free_bytes, m.host_total_bytes,
                          f"{name}: discrete, fast tier = GPU memory, then host RAM, then disk ({why}){_host_note(m)}")


def _host_note(m: Machine) -> str:
    return f"; {m.host_note}" if m.host_note else ""


def _unified_free(m: Machine) -> int:
    """Free memory of one pool. A device that says it is integrated (or is known to be) gets MemAvailable, which
    counts the page cache the OS would give up where cudaMemGetInfo does not (sglang #10075); any other device
    taken for unified (by its size, or unified_memory=on) gets the smaller figure, so a discrete card is never
    budgeted beyond its own free memory."""
    gpu = m.gpu
    if m.gpu_free_bytes is None or bool(getattr(gpu, "is_integrated", False)) or \
            known_integrated(str(getattr(gpu, "name", ""))) is not None:
        return m.host_free_bytes
    return min(m.host_free_bytes, m.gpu_free_bytes)

"""Where the fast tier lives and whether host and device memory are one physical pool.

On unified memory (Apple silicon, NVIDIA GB10 / Grace-Blackwell desktops, Jetson) the "GPU memory" and the "host
RAM" are the same DRAM: budgeting them separately would count every byte twice and is how a 128 GB box gets
OOM-killed by its own server. CUDA reports such devices as integrated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeserve.memory.budget import available_memory_bytes


@dataclass(frozen=True)
class MemoryTopology:
    device_type: str  # "cpu" or "cuda"
    unified: bool  # host and device share one physical pool: one budget
    fast_free_bytes: int  # free memory of the fast tier now (device memory, or RAM)
    host_free_bytes: int  # free host RAM now (the same pool when unified)
    reason: str


def detect_topology(device: torch.device, cuda_props: Any = None, cuda_free_bytes: int | None = None,
                    host_free_bytes: int | None = None) -> MemoryTopology:
    """Describe the memory behind `device`. The optional arguments stand in for CUDA queries (tests)."""
    host_free = available_memory_bytes() if host_free_bytes is None else host_free_bytes
    if device.type != "cuda":
        return MemoryTopology("cpu", False, host_free, host_free, "CPU: the fast tier is RAM, the slow tier disk")
    props = torch.cuda.get_device_properties(device) if cuda_props is None else cuda_props
    if bool(getattr(props, "is_integrated", False)):
        return MemoryTopology("cuda", True, host_free, host_free,
                              f"{props.name} is integrated (unified memory): host and device budgets are one")
    if cuda_free_bytes is None:  # pragma: no cover - needs a CUDA device
        cuda_free_bytes = int(torch.cuda.mem_get_info(device)[0])
    return MemoryTopology("cuda", False, cuda_free_bytes, host_free,
                          f"{props.name}: fast tier = GPU memory, then host RAM, then disk")

"""The memory a container lets this process use: its cgroup's limit less what the cgroup already holds.

MemAvailable (/proc/meminfo) is the host's figure: in a container (Docker `--memory`, a Kubernetes limit, a systemd
unit's MemoryMax) the kernel kills the process at the cgroup's limit long before the host runs out, so a budget
taken from MemAvailable alone over-commits and ends in an OOM kill. `read_cgroup_memory` reads the limit that
applies to this process:

- cgroup v2 (one `0::/path` line in /proc/self/cgroup): `memory.max` of the process's cgroup and of each ancestor
  (a parent's limit binds its children too); the binding level is the one with the least room left;
- cgroup v1 (a `N:...memory...:/path` line): `memory.limit_in_bytes` and `hierarchical_memory_limit` (memory.stat)
  of the process's memory cgroup.

"In use" is the cgroup's working set, as the kubelet counts it: usage less the inactive file pages (page cache the
kernel reclaims before it kills anything). A value of "max" (v2) or the v1 sentinel near 2**63 means no limit.
Paths that do not exist (a cgroup namespace shows the container's cgroup as "/") are looked up at the mount root.
Pure file reading: tests point `proc_cgroup` and the mount roots at a folder they wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NO_LIMIT = 2**62  # v1 writes 9223372036854771712 (PAGE_COUNTER_MAX pages); anything this large is "no limit"
V2_ROOT = Path("/sys/fs/cgroup")
V1_ROOT = Path("/sys/fs/cgroup/memory")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class CgroupMemory:
    limit_bytes: int  # the limit that binds (the least room left among the levels that have one)
    used_bytes: int  # that level's working set: usage less inactive file pages
    where: str  # the cgroup folder it was read from, for the start-up line

    @property
    def available_bytes(self) -> int:
        return max(0, self.limit_bytes - self.used_bytes)


def read_cgroup_memory(proc_cgroup: Path = PROC_CGROUP, v2_root: Path = V2_ROOT,
                       v1_root: Path = V1_ROOT) -> CgroupMemory | None:
    """The memory limit that applies to this process, or None (no cgroup limit, or nothing readable)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    v1_path = v2_path = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif "memory" in parts[1].split(","):
            v1_path = parts[2]
    if v1_path is not None:
        return _read_v1(_folder(v1_root, v1_path))
    if v2_path is not None:
        return _read_v2(v2_root, v2_path)
    return None


def _folder(root: Path, path: str) -> Path:
    """The cgroup's folder under its mount root; the root itself where a namespace hides the path."""
    folder = root / path.lstrip("/")
    return folder if folder.is_dir() else root


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= NO_LIMIT else value


def _stat(folder: Path, key: str) -> int:
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _read_v2(root: Path, path: str) -> CgroupMemory | None:
    best: CgroupMemory | None = None
    folder = _folder(root, path)
    while True:
        limit = _number(folder / "memory.max")
        if limit is not None:
            current = _number(folder / "memory.current") or 0
            level = CgroupMemory(limit, max(0, current - _stat(folder, "inactive_file")), str(folder))
            if best is None or level.available_bytes < best.available_bytes:
                best = level
        if folder == root or root not in folder.parents:
            return best
        folder = folder.parent


def _read_v1(folder: Path) -> CgroupMemory | None:
    limits = [v for v in (_number(folder / "memory.limit_in_bytes"),
                          _stat(folder, "hierarchical_memory_limit") or None) if v is not None and v < NO_LIMIT]
    if not limits:
        return None
    usage = _number(folder / "memory.usage_in_bytes") or 0
    return CgroupMemory(min(limits), max(0, usage - _stat(folder, "total_inactive_file")), str(folder))

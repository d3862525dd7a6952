"""A memory limit for one benchmark process, page cache included: a cgroup of its own.

Why: "disk offload" only reads the disk when the machine's memory cannot hold the offloaded weights. On a bench
machine with RAM to spare, accelerate's offload folder (read through np.memmap) stays in the page cache after the
first token, and the peer runs at memory speed with a resident set far above its `max_memory` budget. A machine
that really has less memory than the model is what the offloaded case stands for; a memory cgroup is that machine:
its limit charges anonymous memory and the page cache the process reads through alike, and reclaims the cache
first. moeserve gets the same limit (its misses are O_DIRECT reads, which the page cache never holds).

cgroup v2 (`memory.max`, swap off) where the unified hierarchy has the memory controller, else cgroup v1
(`memory.limit_in_bytes`). Creating one needs write access to the hierarchy (root, or a delegated subtree); the
error says so in one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from moeserve.errors import MoeserveError

CGROUP_ROOT = Path("/sys/fs/cgroup")


class MemoryLimitError(MoeserveError):
    """No memory cgroup could be made or joined."""


@dataclass(frozen=True)
class MemoryCgroup:
    """A cgroup directory whose processes share `limit_bytes` of memory (RSS and page cache)."""

    path: Path
    version: int  # 1 or 2
    limit_bytes: int

    def join(self) -> None:
        """Move the calling process in: everything it allocates or reads from now on is charged here."""
        try:
            (self.path / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError as err:
            raise MemoryLimitError(f"cannot join the memory cgroup {self.path}: {err.strerror or err}") from None

    def peak_bytes(self) -> int | None:
        """The most memory (RSS + page cache) charged at once, or None where the kernel does not say."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def remove(self) -> None:
        """Delete the (empty) cgroup; its remaining page-cache charges go to the parent. Never raises."""
        try:
            self.path.rmdir()
        except OSError:
            pass


def _own_cgroup(controller: str | None, root: Path, proc_self: Path) -> Path | None:
    """This process's cgroup directory in the hierarchy of `controller` (v1) or the unified one (None)."""
    try:
        lines = proc_self.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if (controller is None and controllers == "") or (controller in controllers.split(",")):
            mount = root / "memory" if controller == "memory" else root
            candidate = mount / rel.lstrip("/")
            # Inside a cgroup namespace the mount's root already is our cgroup, and the path does not exist.
            return candidate if candidate.is_dir() else mount
    return None


def create(limit_bytes: int, name: str, root: Path = CGROUP_ROOT,
           proc_self: Path = Path("/proc/self/cgroup")) -> MemoryCgroup:
    """A new cgroup `name` limited to `limit_bytes`, beside this process's own (v2 if it has the memory
    controller, else v1). MemoryLimitError (one line, what to do) when the hierarchy is missing or read-only."""
    if limit_bytes <= 0:
        raise MemoryLimitError(f"a memory limit must be positive (got {limit_bytes} bytes)")
    unified = root / "cgroup.controllers"
    try:
        v2 = unified.is_file() and "memory" in unified.read_text().split()
    except OSError:
        v2 = False
    if v2:
        parent = _own_cgroup(None, root, proc_self) or root
        version, files = 2, {"memory.max": str(limit_bytes), "memory.swap.max": "0"}
    elif (root / "memory").is_dir():
        parent = _own_cgroup("memory", root, proc_self) or root / "memory"
        version, files = 1, {"memory.limit_in_bytes": str(limit_bytes)}
    else:
        raise MemoryLimitError(f"no memory cgroup hierarchy under {root} (cgroup v1 'memory' or v2 with the memory "
                               "controller); drop --memory-limit-gb on this machine")
    if v2:  # a child gets the memory controller only if its parent hands it down
        control = parent / "cgroup.subtree_control"
        try:
            if "memory" not in control.read_text().split():
                control.write_text("+memory\n")
        except OSError as err:
            raise MemoryLimitError(f"cannot enable the memory controller in {control}: {err.strerror or err} "
                                   "(it needs root or a delegated cgroup; or drop --memory-limit-gb)") from None
    path = parent / name
    try:
        path.mkdir()
    except FileExistsError:
        pass
    except OSError as err:
        raise MemoryLimitError(f"cannot create the memory cgroup {path}: {err.strerror or err} (it needs root or a "
                               "delegated cgroup; or drop --memory-limit-gb)") from None
    group = MemoryCgroup(path, version, limit_bytes)
    for fname, value in files.items():
        f = path / fname
        if fname == "memory.swap.max" and not f.exists():
            continue  # kernels without swap accounting: no swap to turn off
        try:
            f.write_text(value + "\n")
        except OSError as err:
            group.remove()
            raise MemoryLimitError(f"cannot set {f}: {err.strerror or err}; drop --memory-limit-gb") from None
    return group

"""A container's memory limit caps the host RAM the budget sees (memory/cgroup.py, topology.host_memory): cgroup v2
and v1 layouts written by hand as the kernel shows them, the ancestor rule, "no limit" forms, and the start-up note."""

from __future__ import annotations

from pathlib import Path

import torch

from moeserve.memory.cgroup import CgroupMemory, read_cgroup_memory
from moeserve.memory.topology import Machine, detect_topology, host_memory

GiB = 1024**3


def _write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1) if name.startswith("memory_") else folder / name).write_text(text)


def _v2(tmp_path: Path, self_path: str) -> tuple[Path, Path]:
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::{self_path}\n")
    return proc, tmp_path / "v2"


def test_v2_limit_less_working_set(tmp_path: Path) -> None:
    proc, root = _v2(tmp_path, "/")
    _write(root, memory_max=str(16 * GiB), memory_current=str(6 * GiB),
           memory_stat=f"anon {4 * GiB}\ninactive_file {2 * GiB}\nactive_file 0\n")
    got = read_cgroup_memory(proc, root, tmp_path / "v1")
    assert got == CgroupMemory(16 * GiB, 4 * GiB, str(root))
    assert got.available_bytes == 12 * GiB


def test_v2_max_means_no_limit_and_an_ancestor_binds(tmp_path: Path) -> None:
    proc, root = _v2(tmp_path, "/kubepods/pod1/ctr")
    _write(root, memory_max="max", memory_current="0")
    _write(root / "kubepods", memory_max="max", memory_current=str(1 * GiB))
    _write(root / "kubepods" / "pod1", memory_max=str(8 * GiB), memory_current=str(5 * GiB),
           memory_stat=f"inactive_file {1 * GiB}\n")
    _write(root / "kubepods" / "pod1" / "ctr", memory_max="max", memory_current=str(3 * GiB))
    got = read_cgroup_memory(proc, root, tmp_path / "v1")
    assert got is not None and got.limit_bytes == 8 * GiB and got.available_bytes == 4 * GiB
    assert got.where.endswith("pod1")
    (root / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    assert read_cgroup_memory(proc, root, tmp_path / "v1") is None  # no level has a limit


def test_v2_namespaced_path_is_read_at_the_root(tmp_path: Path) -> None:
    proc, root = _v2(tmp_path, "/system.slice/docker-abc.scope")  # not under this mount: the namespace's root
    _write(root, memory_max=str(4 * GiB), memory_current=str(1 * GiB))
    got = read_cgroup_memory(proc, root, tmp_path / "v1")
    assert got is not None and got.available_bytes == 3 * GiB and got.where == str(root)


def test_v1_limit_sentinel_and_hierarchy(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/docker/abc\n1:cpu:/\n0::/\n")
    folder = tmp_path / "v1" / "docker" / "abc"
    _write(folder, memory_limit_in_bytes="9223372036854771712", memory_usage_in_bytes=str(3 * GiB),
           memory_stat=f"hierarchical_memory_limit 9223372036854771712\ntotal_inactive_file {1 * GiB}\n")
    assert read_cgroup_memory(proc, tmp_path / "v2", tmp_path / "v1") is None  # the unlimited sentinel
    (folder / "memory.stat").write_text(f"hierarchical_memory_limit {10 * GiB}\ntotal_inactive_file {1 * GiB}\n")
    got = read_cgroup_memory(proc, tmp_path / "v2", tmp_path / "v1")
    assert got == CgroupMemory(10 * GiB, 2 * GiB, str(folder))


def test_unreadable_or_garbled_is_no_limit(tmp_path: Path) -> None:
    assert read_cgroup_memory(tmp_path / "absent", tmp_path, tmp_path) is None
    proc, root = _v2(tmp_path, "/")
    _write(root, memory_max="garbage")
    assert read_cgroup_memory(proc, root, tmp_path / "v1") is None


def test_host_memory_is_capped_by_the_limit_and_says_so() -> None:
    assert host_memory(64 * GiB, 40 * GiB, None) == (64 * GiB, 40 * GiB, "")
    roomy = CgroupMemory(128 * GiB, 1 * GiB, "/sys/fs/cgroup")
    assert host_memory(64 * GiB, 40 * GiB, roomy) == (64 * GiB, 40 * GiB, "")  # the host binds first
    tight = CgroupMemory(16 * GiB, 6 * GiB, "/sys/fs/cgroup")
    total, free, note = host_memory(64 * GiB, 40 * GiB, tight)
    assert (total, free) == (16 * GiB, 10 * GiB)
    assert "cgroup limit 16.0 GiB" in note and "10.0 GiB available" in note and "MemAvailable 40.0 GiB" in note
    topology = detect_topology(torch.device("cpu"), "auto", Machine(total, free, host_note=note))
    assert topology.fast_free_bytes == 10 * GiB and topology.reason.endswith(note)


def test_this_machine_reads_without_error() -> None:
    got = read_cgroup_memory()  # whatever this machine has: None or a limit with its folder
    assert got is None or (got.limit_bytes > 0 and Path(got.where).is_dir())

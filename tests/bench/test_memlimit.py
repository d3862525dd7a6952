"""The bench's memory limit (bench/memlimit.py): which cgroup files it writes, on fake hierarchies; and, where this
machine lets us make a real cgroup, that a worker inside it is really held to the limit, page cache included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moeserve.bench import memlimit
from moeserve.bench.memlimit import MemoryLimitError, create


def _proc_self(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "proc_self_cgroup"
    p.write_text(text)
    return p


def test_v1_group_beside_our_own_with_the_limit_written(tmp_path):
    root = tmp_path / "cg"
    own = root / "memory" / "jobs" / "me"
    own.mkdir(parents=True)
    proc = _proc_self(tmp_path, "9:name=systemd:/\n4:memory:/jobs/me\n0::/\n")
    group = create(3 * 2**30, "bench-x", root, proc)
    assert group.version == 1 and group.path == own / "bench-x"
    assert (group.path / "memory.limit_in_bytes").read_text() == f"{3 * 2**30}\n"
    (group.path / "memory.max_usage_in_bytes").write_text("12345\n")
    assert group.peak_bytes() == 12345
    for f in group.path.iterdir():  # a real cgroup directory's files vanish with it; fakes must be removed
        f.unlink()
    group.remove()
    assert not group.path.exists()


def test_v1_inside_a_cgroup_namespace_uses_the_mount_root(tmp_path):
    root = tmp_path / "cg"
    (root / "memory").mkdir(parents=True)
    proc = _proc_self(tmp_path, "4:memory:/not/visible/here\n")  # our path is outside the namespace's view
    group = create(2**30, "g", root, proc)
    assert group.path == root / "memory" / "g"


def test_v2_enables_the_controller_and_turns_swap_off(tmp_path):
    root = tmp_path / "cg"
    own = root / "user.slice"
    own.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (own / "cgroup.subtree_control").write_text("cpu\n")
    proc = _proc_self(tmp_path, "0::/user.slice\n")
    # A real kernel creates memory.swap.max with the directory; the fake makes it in advance to be written.
    (own / "g").mkdir()
    (own / "g" / "memory.swap.max").write_text("max\n")
    group = create(5 * 2**20, "g", root, proc)
    assert group.version == 2 and group.path == own / "g"
    assert (own / "cgroup.subtree_control").read_text() == "+memory\n"
    assert (group.path / "memory.max").read_text() == f"{5 * 2**20}\n"
    assert (group.path / "memory.swap.max").read_text() == "0\n"


def test_no_hierarchy_or_a_bad_limit_is_a_one_line_error(tmp_path):
    with pytest.raises(MemoryLimitError, match="no memory cgroup hierarchy") as err:
        create(2**30, "g", tmp_path / "empty", _proc_self(tmp_path, "0::/\n"))
    assert "\n" not in str(err.value)
    with pytest.raises(MemoryLimitError, match="positive"):
        create(0, "g", tmp_path, _proc_self(tmp_path, "0::/\n"))


def test_cli_rejects_a_non_positive_limit(tmp_path, capsys):
    from moeserve.cli import main

    rc = main(["bench", "--shape", "tiny", "--peers", "none", "--memory-limit-gb", "0", "--cache-dir", str(tmp_path)])
    assert rc == 1
    assert "--memory-limit-gb must be positive" in capsys.readouterr().err


def _real_cgroup_or_skip(limit: int) -> memlimit.MemoryCgroup:
    try:
        return create(limit, f"moeserve-test-{os.getpid()}")
    except MemoryLimitError as err:
        pytest.skip(f"no writable memory cgroup here: {err}")


def test_a_process_in_the_group_is_held_to_the_limit_page_cache_included(tmp_path):
    """Reading a file 3x the limit through the page cache succeeds (the cache is reclaimed) and the group's peak
    stays within the limit; the same process outside would have cached all of it."""
    limit = 64 * 2**20
    group = _real_cgroup_or_skip(limit)
    try:
        data = tmp_path / "big.bin"
        with open(data, "wb") as f:
            for _ in range(12):
                f.write(os.urandom(16 * 2**20))  # 192 MiB
        code = ("import sys; from pathlib import Path; from moeserve.bench.memlimit import MemoryCgroup\n"
                f"MemoryCgroup(Path({str(group.path)!r}), {group.version}, {limit}).join()\n"
                f"f = open({str(data)!r}, 'rb')\n"
                "while f.read(8 << 20): pass\n")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
        peak = group.peak_bytes()
        if peak is None:
            pytest.skip("the kernel reports no peak for this cgroup")
        assert 8 * 2**20 < peak <= limit
    finally:
        group.remove()


def test_bench_runs_each_engine_under_the_limit_and_reports_its_peak(tmp_path):
    import json

    from moeserve.cli import main

    probe = _real_cgroup_or_skip(2**30)
    probe.remove()
    out = tmp_path / "bench.json"
    rc = main(["bench", "--shape", "tiny", "--cache-dir", str(tmp_path / "cache"), "--tokens", "2", "--repeats", "1",
               "--prompt-len", "4", "--cases", "decode-b1", "--peers", "none", "--memory-limit-gb", "3",
               "--json", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["settings"]["memory_limit_bytes"] == 3 * 2**30
    (row,) = summary["rows"]
    assert 10 * 2**20 < row["memory_peak_bytes"] <= 3 * 2**30
    assert not list(probe.path.parent.glob(f"moeserve-bench-{os.getpid()}-*"))  # removed after the run

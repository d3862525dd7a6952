"""The JIT builder of moeserve/kernels: fallback reasons, the settings switch, the cache key."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from moeserve import kernels
from moeserve.errors import ConfigError
from tests.kernels.ops import suite_isa


@pytest.fixture
def fresh_status():
    kernels._reset_for_tests()
    yield
    kernels._reset_for_tests()


def test_missing_compiler_falls_back_with_reason(monkeypatch, fresh_status):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    status = kernels.load(suite_isa())
    assert not status.available
    assert "/nonexistent/g++" in status.reason and "not found" in status.reason
    use, reason = kernels.choose("auto", isa=suite_isa())
    assert not use and "torch fallback" in reason and "not found" in reason
    with pytest.raises(ConfigError, match="kernels=cpp"):
        kernels.choose("cpp", isa=suite_isa())


def test_torch_setting_never_builds(monkeypatch, fresh_status):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    assert kernels.choose("torch") == (False, "kernels=torch")
    assert kernels._statuses == {}  # nothing was attempted


def test_cache_folder_respects_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels.cache_root() == tmp_path / "moeserve" / "kernels"


def test_every_cpp_is_compiled_into_one_library():
    status = kernels.load(suite_isa())
    if not status.available:
        pytest.skip(status.reason)
    cpps = sorted(kernels.CSRC.glob("*.cpp"))
    assert cpps
    # one cached object per source, each named after its .cpp, all linked into the one library loaded
    objs = list((kernels.cache_root() / "obj").glob("*.o"))
    for cpp in cpps:
        assert any(o.name.startswith(cpp.stem + "-") for o in objs), cpp
    cmd = kernels._link_command("g++", [kernels.cache_root() / "obj" / f"{c.stem}.o" for c in cpps], kernels.CSRC)
    assert "-shared" in cmd and sum(c.endswith(".o") for c in cmd) == len(cpps)


def test_builds_and_loads():
    status = kernels.load(suite_isa())
    if not status.available and "not found" in status.reason:
        pytest.skip(status.reason)
    assert status.available, status.reason


# A stand-in compiler: each compile (-c) logs its caller's pid, then waits until GO_FILE exists (so the test decides
# when the first build ends); every call writes an empty file at -o
LOGGING_CXX = """#!/bin/sh
case " $* " in *" -c "*)
  echo "$PPID" >> "$COMPILE_LOG"
  while [ ! -e "$GO_FILE" ]; do sleep 0.05; done;;
esac
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then : > "$2"; fi; shift; done
"""
BUILD = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
         "from moeserve import kernels; print(kernels._build(kernels._compiler())[1])")


def wait_until(check, timeout: float = 600.0) -> None:  # a hang guard: returns as soon as check() holds
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "hang guard"
        time.sleep(0.02)


def test_two_processes_building_at_once_compile_once(tmp_path):
    """The second process finds no library while the first compiles: it waits on the build lock (and says so),
    then takes the first one's build; every source is compiled once, by the first."""
    fake = tmp_path / "fake-g++"
    fake.write_text(LOGGING_CXX)
    fake.chmod(0o755)
    compile_log, go = tmp_path / "compiles", tmp_path / "go"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "CXX": str(fake),
           "COMPILE_LOG": str(compile_log), "GO_FILE": str(go)}

    def start(name: str) -> subprocess.Popen[str]:
        err = open(tmp_path / f"{name}.err", "w")
        return subprocess.Popen([sys.executable, "-c", BUILD], stdout=subprocess.PIPE, stderr=err, text=True, env=env)

    def compiled_by(proc: subprocess.Popen[str]) -> int:
        return compile_log.read_text().split().count(str(proc.pid)) if compile_log.exists() else 0

    first = start("first")
    wait_until(lambda: compiled_by(first) > 0 or first.poll() is not None)  # it holds the lock, compiling
    second = start("second")
    # the second says it waits for the first; without the lock it would compile beside it
    wait_until(lambda: "waiting for it, then loading its build" in (tmp_path / "second.err").read_text()
               or compiled_by(second) > 0 or second.poll() is not None)
    go.touch()
    outs = [p.communicate(timeout=600)[0] for p in (first, second)]
    assert (first.returncode, second.returncode) == (0, 0), [(tmp_path / f"{n}.err").read_text() for n in
                                                             ("first", "second")]
    assert compiled_by(second) == 0
    assert compiled_by(first) == len(list(kernels.CSRC.glob("*.cpp")))
    assert outs[0].startswith("built ") and "sources compiled" in outs[0], outs[0]
    assert outs[1].startswith("cached ") and "built by another process while this one waited" in outs[1], outs[1]

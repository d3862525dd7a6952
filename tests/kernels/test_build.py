"""The JIT builder of moeserve/kernels: fallback reasons, the settings switch, the cache key."""

from __future__ import annotations

import pytest

from moeserve import kernels
from moeserve.errors import ConfigError


@pytest.fixture
def fresh_status():
    kernels._reset_for_tests()
    yield
    kernels._reset_for_tests()


def test_missing_compiler_falls_back_with_reason(monkeypatch, fresh_status):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    status = kernels.load()
    assert not status.available
    assert "/nonexistent/g++" in status.reason and "not found" in status.reason
    use, reason = kernels.choose("auto")
    assert not use and "torch fallback" in reason and "not found" in reason
    with pytest.raises(ConfigError, match="kernels=cpp"):
        kernels.choose("cpp")


def test_torch_setting_never_builds(monkeypatch, fresh_status):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    assert kernels.choose("torch") == (False, "kernels=torch")
    assert kernels._status is None  # nothing was attempted


def test_cache_folder_respects_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels.cache_root() == tmp_path / "moeserve" / "kernels"


def test_every_cpp_is_compiled_into_one_library():
    status = kernels.load()
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
    status = kernels.load()
    if not status.available and "not found" in status.reason:
        pytest.skip(status.reason)
    assert status.available, status.reason

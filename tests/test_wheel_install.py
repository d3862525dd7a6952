"""A wheel built from this tree installs into a fresh venv and its `moeserve serve` answers on the demo model.

Cheap by design: the wheel is built without build isolation (this venv's setuptools), the fresh venv has no pip
and sees this venv's packages (torch and the other dependencies) through a .pth line, the wheel goes in with
--no-deps --no-index (nothing downloaded), and the C++ kernels come from the build cache (the same sources, found in
the installed package's kernels/csrc). The tree is copied first, so the build leaves no build/ folder here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import REPO, free_socket, wait_healthy

pytestmark = pytest.mark.slow


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH (this tree would look installed) and no MOESERVE_* settings."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("MOESERVE_")}


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check"], check=True,
                   capture_output=True, text=True, timeout=600, env=_clean_env())


def test_the_wheel_installs_in_a_fresh_venv_and_serves(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "moeserve", src / "moeserve", ignore=shutil.ignore_patterns("__pycache__"))
    _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src))
    wheel = next((tmp_path / "dist").glob("moeserve-*.whl"))
    names = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(wheel)], capture_output=True, text=True).stdout
    assert "moeserve/kernels/csrc/ops.h" in names and "moeserve/demo_model/model.safetensors" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    _pip("--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel))
    # then torch & co from this venv (after the install: pip would take this venv's editable moeserve for it)
    Path(site, "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = _clean_env()
    proc = subprocess.Popen([str(venv / "bin" / "moeserve"), "serve", "--port", str(port), "--dtype", "float32",
                             "--threads", "1"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc=proc)
        reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "moeserve-demo", "messages": [{"role": "user", "content": "Who is Mr Darcy?"}],
            "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        out = proc.communicate(timeout=120)[0]
    assert f"{site}/moeserve/demo_model" in out, out  # the installed package served, not this tree
    assert f"moeserve: serving model 'moeserve-demo' at {url}/v1" in out

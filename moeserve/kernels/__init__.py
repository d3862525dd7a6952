"""moeserve's C++ CPU kernels: every ``csrc/*.cpp`` compiled (JIT, with g++) into ONE shared library.

API (other modules rely on exactly this):

- ``load() -> KernelStatus``: builds the library if no cached build matches, loads it with
  ``torch.ops.load_library`` (once per process), and returns ``KernelStatus(available, reason, ...)``. It never
  raises: a missing compiler or a failed build gives ``available=False`` and a one-line ``reason``. Thread-safe,
  and memoised: later calls return the same status.
- The ops are then reachable as ``torch.ops.moeserve.<name>``. Each .cpp registers its ops with
  ``TORCH_LIBRARY_FRAGMENT(moeserve, m)`` (fragments, so any number of files can add ops to the one namespace).
  Headers shared by several files live in ``csrc/*.h``; they are part of the build hash.
- ``choose(setting) -> (use_cpp, reason)`` for EngineSettings.kernels: "auto" = the C++ ops when they build,
  "cpp" = raise ConfigError when they cannot, "torch" = never load them.

Build: ``g++ -O3 -march=native -fopenmp -fPIC -shared -std=c++20`` against the running torch's headers and
libraries (``-D_GLIBCXX_USE_CXX11_ABI`` matching torch, rpath to torch/lib, so libgomp is torch's own). ``CXX``
names another compiler. The library is cached in ``$XDG_CACHE_HOME/moeserve/kernels/<key>/`` (default
``~/.cache``); the key hashes the sources, torch version, compiler version, flags and the CPU's feature flags, so a
different machine or a changed source rebuilds. Builds go to a temporary file renamed into place (atomic), so
two processes that build at once both end up loading a complete library.

Code for AVX512-BF16 is guarded by ``#ifdef __AVX512BF16__`` (or a target attribute plus a runtime check), with
AVX-512F / AVX2 / scalar fallbacks: -march=native on a CPU without them simply compiles the fallback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve.errors import ConfigError

log = logging.getLogger("moeserve.kernels")

CSRC = Path(__file__).with_name("csrc")
LIB_NAME = "moeserve_kernels.so"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++20")


@dataclass(frozen=True)
class KernelStatus:
    available: bool
    reason: str  # one line: how it was obtained ("built in 12.3 s", "cached ...") or why it is not available
    path: str | None = None  # the loaded library


_lock = threading.Lock()
_status: KernelStatus | None = None


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moeserve" / "kernels"


def sources() -> list[Path]:
    """The files that make the library: every csrc/*.cpp (compiled) and csrc/*.h (hashed)."""
    return sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


def _compiler() -> str:
    return os.environ.get("CXX") or "g++"


def _command(cxx: str, cpp_files: list[Path], out: Path) -> list[str]:
    t = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{t / 'include'}",
            f"-I{t / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", *map(str, cpp_files), "-o", str(out),
            f"-L{t / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{t / 'lib'}"]


def _build(cxx: str) -> tuple[Path, str]:
    """(library path, how it was obtained). Raises RuntimeError with a one-line reason."""
    if shutil.which(cxx) is None:
        raise RuntimeError(f"C++ compiler '{cxx}' not found (set CXX or install g++)")
    files = sources()
    cpp_files = [f for f in files if f.suffix == ".cpp"]
    if not cpp_files:
        raise RuntimeError(f"no C++ sources in {CSRC}")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"C++ compiler '{cxx}' does not run: {err}") from None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    for part in (torch.__version__, version, " ".join(FLAGS), str(torch._C._GLIBCXX_USE_CXX11_ABI), _cpu_flags()):
        h.update(part.encode() + b"\0")
    folder = cache_root() / h.hexdigest()[:20]
    lib = folder / LIB_NAME
    if lib.exists():
        return lib, f"cached {lib}"
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    tmp = Path(tmp_name)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(_command(cxx, cpp_files, tmp), capture_output=True, text=True)
        if proc.returncode != 0:
            errors = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.splitlines()[-1:]
            (folder / "build-error.log").write_text(proc.stderr)
            first = errors[0].strip() if errors else f"exit status {proc.returncode}"
            raise RuntimeError(f"build failed ({first}; full log {folder / 'build-error.log'})")
        os.replace(tmp, lib)  # atomic: a concurrent builder's rename just replaces an identical file
    finally:
        tmp.unlink(missing_ok=True)
    return lib, f"built {lib} in {time.monotonic() - t0:.1f} s"


def load() -> KernelStatus:
    """Build (or find cached) and load the library; never raises. See the module docstring."""
    global _status
    with _lock:
        if _status is None:
            try:
                lib, how = _build(_compiler())
                torch.ops.load_library(str(lib))
                _status = KernelStatus(True, how, str(lib))
            except Exception as err:  # noqa: BLE001 - any failure means: run the torch kernels, say why
                _status = KernelStatus(False, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return _status


def _reset_for_tests() -> None:
    """Forget the memoised status (the library itself stays loaded: torch cannot unload it)."""
    global _status
    with _lock:
        _status = None


def choose(setting: str, device_type: str = "cpu") -> tuple[bool, str]:
    """(use the C++ ops, reason) for EngineSettings.kernels; "cpp" raises ConfigError when they cannot be used."""
    if setting == "torch":
        return False, "kernels=torch"
    if device_type != "cpu":
        if setting == "cpp":
            raise ConfigError(f"kernels=cpp: the C++ kernels run on CPU only, the device is {device_type}")
        return False, f"the C++ kernels are CPU only (device {device_type})"
    status = load()
    if not status.available:
        if setting == "cpp":
            raise ConfigError(f"kernels=cpp but the C++ kernels are not available: {status.reason}")
        return False, f"C++ kernels not available, torch fallback: {status.reason}"
    return True, status.reason

"""moeserve's C++ CPU kernels: every ``csrc/*.cpp`` compiled (JIT, with g++) into ONE shared library.

API (other modules rely on exactly this):

- ``load(isa="native") -> KernelStatus``: builds the library for that ISA level if no cached build matches, loads it
  with ``torch.ops.load_library`` (once per process), and returns ``KernelStatus(available, reason, ...)``. It never
  raises: a missing compiler or a failed build gives ``available=False`` and a one-line ``reason``. Thread-safe,
  and memoised: later calls return the same status. ONE library per process (torch cannot unload one): asking
  for another ISA than the one loaded gives ``available=False`` saying so (tests of other ISAs run in a
  subprocess).
- The ops are then reachable as ``torch.ops.moeserve.<name>``. Each .cpp registers its ops with
  ``TORCH_LIBRARY_FRAGMENT(moeserve, m)`` (fragments, so any number of files can add ops to the one namespace).
  Headers shared by several files live in ``csrc/*.h``; they are part of the build hash.
- ``build_subset(cpp_names, isa) -> Path``: a library of only those sources, built or cached, NOT loaded (tests
  that run a few ops on every ISA level in subprocesses: tests/kernels/test_canonical_isa.py).
- ``choose(setting, device_type, isa) -> (use_cpp, reason)`` for EngineSettings.kernels and .cpu_isa: "auto" = the
  C++ ops when they build, "cpp" = raise ConfigError when they cannot, "torch" = never load them; the reason names
  the ISA the library was built for.

ISA levels (EngineSettings.cpu_isa; ``ISA_FLAGS``), on x86-64: ``native`` (cpu_isa=auto, the default) =
``-march=native``; ``avx2`` = ``-march=x86-64-v3 -mtune=native`` (AVX2, FMA, F16C: what an AVX2-only CPU runs, and
what tests use to run those paths on a wider CPU); ``generic`` = ``-march=x86-64`` (no SIMD beyond SSE2: the scalar
paths). On aarch64: ``native`` = ``-mcpu=native`` (NEON, and BF16 where the CPU has it), ``generic`` =
``-march=armv8-a`` (NEON only: every aarch64 CPU), ``avx2`` refused. On other machines ``native`` =
``-march=native`` and ``generic`` the compiler's default target. Every source chooses its code by the compiler's ISA
macros (``__AVX512BF16__``, ``__AVX2__``, ``__ARM_NEON``, ...), and a runtime CPU check (``__builtin_cpu_supports``)
only ever narrows that, so a ``target``-attribute AVX-512 function is never chosen in an avx2 build. Each level is
its own cached library (the flags are part of the key). x86 intrinsics are guarded by their ISA macros, so every
source compiles for aarch64 (tests/kernels/test_aarch64_qemu.py cross-compiles them, and runs the canonical ops'
numeric cores and the 4-bit expert op's dots under qemu-aarch64 against the x86 builds).

Build: ``g++ -O3 <ISA flags> -fopenmp -fPIC -shared -std=c++20`` against the running torch's headers and
libraries (``-D_GLIBCXX_USE_CXX11_ABI`` matching torch, rpath to torch/lib, so libgomp is torch's own). ``CXX``
names another compiler. The library is cached in ``$XDG_CACHE_HOME/moeserve/kernels/<key>/`` (default
``~/.cache``); the key hashes the sources, torch version, compiler version, flags and the CPU's feature flags, so a
different machine or a changed source rebuilds. Each .cpp is compiled (in parallel) to an object cached under
``obj/`` by its own key, so editing one file recompiles only that one. Objects and library go to temporary files
renamed into place (atomic), and a build holds an exclusive ``flock`` on ``<cache>/build.lock``: a process that
finds no library while another builds it waits, then loads that build instead of compiling the same sources again
(tests spawning engine processes before the first build finished each compiled everything).

Code for AVX512-BF16 is guarded by ``#ifdef __AVX512BF16__`` (or a target attribute plus a runtime check inside
such a guard), with AVX-512F / AVX2 / scalar fallbacks: -march=native on a CPU without them simply compiles the
fallback. The bf16 dot products of the dense GEMV and the interleaved expert op give the same bits on every level
(csrc/canonical_dot.h).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve.errors import ConfigError

log = logging.getLogger("moeserve.kernels")

CSRC = Path(__file__).with_name("csrc")
LIB_NAME = "moeserve_kernels.so"
_X86 = platform.machine().lower() in ("x86_64", "amd64")
_ARM64 = platform.machine().lower() in ("aarch64", "arm64")


def _isa_flags(x86: bool, arm64: bool) -> dict[str, tuple[str, ...]]:
    """The ISA levels a library can be built for on such a machine, and their flags (see the module docstring)."""
    if arm64:
        return {"native": ("-mcpu=native",), "avx2": ("-march=x86-64-v3", "-mtune=native"),
                "generic": ("-march=armv8-a",)}
    return {"native": ("-march=native",), "avx2": ("-march=x86-64-v3", "-mtune=native"),
            "generic": ("-march=x86-64", "-mtune=generic") if x86 else ()}


ISA_FLAGS: dict[str, tuple[str, ...]] = _isa_flags(_X86, _ARM64)
# /proc/cpuinfo flags an x86-64-v3 build may use (without them its code would die on an illegal instruction)
AVX2_CPU_FLAGS = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe")


def flags(isa: str = "native") -> tuple[str, ...]:
    """The compile and link flags of an ISA level."""
    return ("-O3", *ISA_FLAGS[isa], "-fopenmp", "-fPIC", "-shared", "-std=c++20")


FLAGS = flags("native")  # the default build's flags


@dataclass(frozen=True)
class KernelStatus:
    available: bool
    reason: str  # one line: how it was obtained ("built in 12.3 s", "cached ...") or why it is not available
    path: str | None = None  # the loaded library
    isa: str = "native"  # the ISA level it was asked for (ISA_FLAGS)


_lock = threading.Lock()
_statuses: dict[str, KernelStatus] = {}  # per ISA level asked for
_loaded: Path | None = None  # the library loaded in this process (torch cannot unload one)
_loaded_isa: str | None = None


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moeserve" / "kernels"


def sources() -> list[Path]:
    """The files that make the library: every csrc/*.cpp (compiled) and csrc/*.h (hashed)."""
    return sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))


def _cpu_flags() -> str:
    """The CPU's feature flags (x86: "flags", aarch64: "Features" in /proc/cpuinfo), sorted: part of the cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


def _compiler() -> str:
    return os.environ.get("CXX") or "g++"


def _torch_dir() -> Path:
    return Path(torch.__file__).parent


def _compile_command(cxx: str, cpp: Path, obj: Path, isa: str = "native") -> list[str]:
    t = _torch_dir()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, *flags(isa), "-c", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{t / 'include'}",
            f"-I{t / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", str(cpp), "-o", str(obj)]


def _link_command(cxx: str, objs: list[Path], out: Path, isa: str = "native") -> list[str]:
    t = _torch_dir()
    return [cxx, *flags(isa), *map(str, objs), "-o", str(out), f"-L{t / 'lib'}", "-lc10", "-ltorch_cpu",
            f"-Wl,-rpath,{t / 'lib'}"]


def _run(cmd: list[str], log_file: Path) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        log_file.write_text(proc.stderr)
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.splitlines()[-1:]
        first = errors[0].strip() if errors else f"exit status {proc.returncode}"
        raise RuntimeError(f"build failed ({first}; full log {log_file})")


def _atomic_build(target: Path, build: Callable[[Path], None]) -> None:
    """build(tmp) then rename tmp -> target (atomic: a concurrent builder just replaces an identical file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".build-", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        build(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _build(cxx: str, isa: str = "native", only: tuple[str, ...] | None = None) -> tuple[Path, str]:
    """(library path, how it was obtained). Raises RuntimeError with a one-line reason.

    Each .cpp is compiled to an object cached by its own key (its text, the headers, torch, compiler, flags, CPU),
    in parallel; the library, keyed by all of them, links the objects. Editing one file recompiles that file. One
    process builds at a time (_build_lock); one that waited finds the library the other built."""
    lib, cpp_files, objs = _build_plan(cxx, isa, only)
    if lib.exists():
        return lib, f"cached {lib}"
    with _build_lock(cache_root()) as waited_s:
        if lib.exists():
            return lib, f"cached {lib} (built by another process while this one waited {waited_s:.1f} s)"
        return lib, _compile_and_link(cxx, lib, cpp_files, objs, isa)


def _build_plan(cxx: str, isa: str = "native", only: tuple[str, ...] | None = None
                ) -> tuple[Path, list[Path], list[Path]]:
    """(library path, .cpp files, their object paths): the cache keys of this compiler, torch and CPU. `only`: just
    these .cpp names (build_subset); their objects are those of the full library."""
    if shutil.which(cxx) is None:
        raise RuntimeError(f"C++ compiler '{cxx}' not found (set CXX or install g++)")
    cpp_files = [f for f in sorted(CSRC.glob("*.cpp")) if only is None or f.name in only]
    if only is not None and len(cpp_files) != len(set(only)):
        raise RuntimeError(f"no such C++ sources in {CSRC}: {sorted(set(only) - {f.name for f in cpp_files})}")
    headers = sorted(CSRC.glob("*.h"))
    if not cpp_files:
        raise RuntimeError(f"no C++ sources in {CSRC}")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"C++ compiler '{cxx}' does not run: {err}") from None
    common = hashlib.sha256()
    for part in (torch.__version__, version, " ".join(flags(isa)), str(torch._C._GLIBCXX_USE_CXX11_ABI),
                 _cpu_flags()):
        common.update(part.encode() + b"\0")
    for f in headers:
        common.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    keys = []
    for f in cpp_files:
        h = common.copy()
        h.update(f.name.encode() + b"\0" + f.read_bytes())
        keys.append(h.hexdigest()[:20])
    root = cache_root()
    lib = root / hashlib.sha256("".join(keys).encode()).hexdigest()[:20] / LIB_NAME
    return lib, cpp_files, [root / "obj" / f"{f.stem}-{key}.o" for f, key in zip(cpp_files, keys)]


@contextmanager
def _build_lock(root: Path) -> Iterator[float]:
    """Holds an exclusive flock on root/build.lock (released when the process ends, however it ends); yields the
    seconds it waited for another process's build."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "build.lock", "a") as lock_file:
        t0 = time.monotonic()
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("kernels: another process is building the C++ kernels (lock %s): waiting for it, then loading "
                     "its build", lock_file.name)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield time.monotonic() - t0
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _compile_and_link(cxx: str, lib: Path, cpp_files: list[Path], objs: list[Path], isa: str = "native") -> str:
    """Compiles the sources whose object is not cached (in parallel), links `lib`; returns how it went."""
    t0 = time.monotonic()
    todo = [(f, o) for f, o in zip(cpp_files, objs) if not o.exists()]
    workers = max(1, min(len(todo), os.cpu_count() or 1))
    # announced before it starts: a first build takes minutes on a small machine, and nothing else is printed then
    log.info("kernels: building C++ kernels (first use of these sources on this machine, about %s s: %d of %d "
             "sources to compile on %d cores) into %s; cached afterwards", _estimate_seconds(len(todo), workers),
             len(todo), len(cpp_files), workers, lib.parent)
    compiled = iter(range(1, len(todo) + 1))  # next() is atomic under the GIL: one count per finished source

    def compile_one(item: tuple[Path, Path]) -> None:
        cpp, obj = item
        _atomic_build(obj, lambda tmp: _run(_compile_command(cxx, cpp, tmp, isa), obj.with_suffix(".log")))
        log.info("kernels: compiled %s (%d of %d, %.0f s)", cpp.name, next(compiled), len(todo),
                 time.monotonic() - t0)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(compile_one, todo))
    _atomic_build(lib, lambda tmp: _run(_link_command(cxx, objs, tmp, isa), lib.with_suffix(".log")))
    return (f"built {lib} in {time.monotonic() - t0:.1f} s ({len(todo)} of {len(cpp_files)} "
            "sources compiled, the rest cached)")


# Seconds one source takes to compile with -O3 on one core of a small machine, quiet and busy: a fresh clone on 2 quiet
# cores built 17 sources in 78 s (2026-11-26); on a busy machine the fresh-clone run of issue 20 took ~370 s for 11.
# An estimate for the start-up line, nothing more.
SOURCE_COMPILE_SECONDS = (9, 80)


def _estimate_seconds(sources: int, workers: int) -> str:
    """About how long `sources` files take on `workers` parallel compilers, quiet to busy: "90-720"."""
    rounds = -(-sources // workers)
    return "-".join(str(rounds * s) for s in SOURCE_COMPILE_SECONDS)


def build_subset(cpp_names: tuple[str, ...], isa: str = "native") -> Path:
    """Builds (or finds cached) a library of only these csrc/*.cpp files for ISA level `isa`, and returns its path
    WITHOUT loading it: for a test that runs a few ops on every ISA level, each in a subprocess that loads it (every
    source for every level costs minutes of CI). The objects are the full library's (same keys), so the ops' code is
    that of the full library. Raises RuntimeError with a one-line reason (also when this CPU cannot run `isa`)."""
    level = isa_level(isa)
    why_not = _unrunnable(level)
    if why_not is not None:
        raise RuntimeError(why_not)
    return _build(_compiler(), level, tuple(cpp_names))[0]


def isa_level(isa: str) -> str:
    """The ISA level of a cpu_isa setting: "auto" (or "native") -> "native"; "avx2", "generic" as they are."""
    level = "native" if isa == "auto" else isa
    if level not in ISA_FLAGS:
        raise ValueError(f"unknown ISA level {isa!r} (valid: auto, {', '.join(ISA_FLAGS)})")
    return level


def _unrunnable(isa: str) -> str | None:
    """Why a library of this ISA level cannot run on this CPU, or None."""
    if isa != "avx2":
        return None
    if not _X86:
        return f"isa=avx2 needs an x86-64 CPU, this one is {platform.machine()}"
    missing = [f for f in AVX2_CPU_FLAGS if f not in _cpu_flags().split()]
    return f"isa=avx2: this CPU lacks {', '.join(missing)}" if missing else None


def load(isa: str = "native") -> KernelStatus:
    """Build (or find cached) and load the library of ISA level `isa` (native, avx2, generic; "auto" = native);
    never raises. See the module docstring."""
    with _lock:
        try:
            level = isa_level(isa)
        except ValueError as err:
            return KernelStatus(False, str(err), isa=isa)
        if level not in _statuses:
            _statuses[level] = _load_locked(level)
        return _statuses[level]


def _load_locked(isa: str) -> KernelStatus:
    global _loaded, _loaded_isa
    if _loaded_isa is not None and _loaded_isa != isa:
        return KernelStatus(False, f"the isa={_loaded_isa} kernels are loaded in this process and torch cannot unload "
                            f"them: isa={isa} needs another process", isa=isa)
    why_not = _unrunnable(isa)
    if why_not is not None:
        return KernelStatus(False, why_not, isa=isa)
    try:
        lib, how = _build(_compiler(), isa)
        if _loaded is None:
            torch.ops.load_library(str(lib))
            _loaded, _loaded_isa = lib, isa
        elif lib != _loaded:  # a second library would register the same ops again: torch aborts
            how = f"{how}; NOT loaded: {_loaded} was loaded before in this process (restart to use it)"
            lib = _loaded
        return KernelStatus(True, f"{how}; {built_for(isa)}", str(lib), isa)
    except Exception as err:  # noqa: BLE001 - any failure means: run the torch kernels, say why
        return KernelStatus(False, str(err).splitlines()[0] if str(err) else type(err).__name__, isa=isa)


def built_for(isa: str) -> str:
    """The start-up log's words for the loaded library's ISA: the level, its flags, the bf16 dot implementation."""
    march = f"{' '.join(ISA_FLAGS[isa]) or 'the default target'} on {platform.machine()}"
    try:
        dots = str(torch.ops.moeserve.canonical_dot_isa())
    except (AttributeError, RuntimeError):  # a library loaded before this op existed (sources edited meanwhile)
        dots = "unknown"
    return f"built for isa={isa} ({march}; bf16 dots: {dots})"


def _reset_for_tests() -> None:
    """Forget the memoised statuses (the library itself stays loaded: torch cannot unload it)."""
    with _lock:
        _statuses.clear()


def choose(setting: str, device_type: str = "cpu", isa: str = "auto") -> tuple[bool, str]:
    """(use the C++ ops, reason) for EngineSettings.kernels and .cpu_isa; "cpp" raises ConfigError when they cannot
    be used. The reason names the ISA the library was built for (the engine logs it)."""
    if setting == "torch":
        return False, "kernels=torch"
    if device_type != "cpu":
        if setting == "cpp":
            raise ConfigError(f"kernels=cpp: the C++ kernels run on CPU only, the device is {device_type}")
        return False, f"the C++ kernels are CPU only (device {device_type})"
    status = load(isa)
    if not status.available:
        if setting == "cpp":
            raise ConfigError(f"kernels=cpp but the C++ kernels are not available: {status.reason}")
        return False, f"C++ kernels not available, torch fallback: {status.reason}"
    return True, status.reason

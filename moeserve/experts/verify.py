"""Verified bytes: every expert unit read from a slower tier is checked against the checksum of its first read.

Where a unit's bytes come from a disk (the checkpoint, or the int8 spill file), a byte that changed since (the
file was replaced or edited under a running server, a bad sector, a truncated copy) would otherwise become a wrong
answer with no error. The first read of a unit records its checksum (for the spill file: the checksums written
with it when it was built, read from its header) and checks it for NaN / infinity (checkpoint/finite.py); every
later read is checked against it. A mismatch marks the unit bad and raises CorruptUnitError naming the unit and
its file: the step that needed it fails and LLMEngine.step runs the batch again request by request, so only the
requests that need the unit fail (the server answers 500); the engine goes on, later requests that need the unit
fail fast with the same message (a bad unit stays bad until a restart), and `/health` reports the engine as
degraded. A read that fails or comes back short (a truncated file) is an ExpertLoadError too, but marks nothing:
the next miss reads again.

A unit no request has read yet gets its checksum from the reference scan (`ReferenceScan`): after the load, a
background thread reads every unit that has none, one at a time and only while the engine is idle, so a unit
changed on disk under a running server is caught even when no request had needed it before. Until the scan has
reached a unit, that unit's first miss takes the reference (a change before then goes unseen).

What this does not catch: a unit already wrong when first read (at the scan or a miss) that holds finite numbers:
the checkpoint carries no checksum to compare with. (The int8 spill file does: its units are checked against the
checksums written when they were made.)

The checksum (`choose_checksum`): the C++ op `unit_checksum` (csrc/checksum.cpp: CRC-32C in 4 stripes, 24-26 GB/s
on the 2-core dev VM against 1.5-2.3 GB/s for the uncached read of a 9.4 MB unit: 6-9% of a miss) where the C++
kernels are loaded, else zlib's CRC-32 (3.1-3.6 GB/s: 65-75% of a miss; `moeserve bench checksum`). The name of
the one in use is written into spill headers; a verifier seeded from a header uses that header's checksum.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from moeserve.errors import CorruptUnitError, MoeserveError

log = logging.getLogger("moeserve")

Key = tuple[int, int]


@dataclass(frozen=True)
class Checksum:
    name: str
    fn: Callable[[torch.Tensor], int]  # contiguous CPU uint8 tensor -> checksum


def _zlib_crc32(unit_bytes: torch.Tensor) -> int:
    return zlib.crc32(memoryview(unit_bytes.numpy()))  # type: ignore[arg-type]


ZLIB = Checksum("crc32-zlib", _zlib_crc32)


def choose_checksum() -> Checksum:
    """The C++ unit_checksum when the kernels library is loaded in this process, else zlib's CRC-32."""
    try:
        op = torch.ops.moeserve.unit_checksum
    except (AttributeError, RuntimeError):
        return ZLIB
    return Checksum("crc32c-4stripe", lambda t: int(op(t)))


def checksum_named(name: str) -> Checksum | None:
    """The checksum called `name` (as written in a spill header) if this process can compute it, else None."""
    if name == ZLIB.name:
        return ZLIB
    chosen = choose_checksum()
    return chosen if chosen.name == name else None


class UnitVerifier:
    """Checksums per unit (first read, or seeded from a spill header) and the units found bad. Thread-safe."""

    def __init__(self, checksum: Checksum, where: Callable[[Key], str],
                 first_read_check: Callable[[Key, torch.Tensor], None] | None = None,
                 advice: Callable[[Key], str] = lambda key: "restore it and restart the server",
                 padding: Sequence[tuple[int, int]] = (),
                 name: Callable[[Key], str] = lambda key: f"expert {key[1]} of layer {key[0]}") -> None:
        self.checksum, self.where, self.first_read_check, self.advice = checksum, where, first_read_check, advice
        self.name = name  # what the unit is, in an error
        # The unit's alignment gaps between fields ([start, end) byte ranges): a read never writes them, so they
        # hold whatever the slot held before; they are zeroed before hashing (nothing reads them), so equal fields
        # give equal checksums.
        self.padding = tuple(padding)
        self.expected: dict[Key, int] = {}
        self.bad: dict[Key, str] = {}
        self.checks = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def seed(self, expected: Mapping[Key, int], checksum_name: str | None = None) -> None:
        """Checksums known before any read (a spill file's header), made with `checksum_name` (default: this
        verifier's). Before any read the verifier switches to that checksum, if this process can compute it;
        otherwise they are dropped (each unit's first read then gives its reference)."""
        with self._lock:
            if checksum_name is not None and checksum_name != self.checksum.name:
                other = checksum_named(checksum_name)
                if other is None or self.expected:
                    log.info("verify: the %s checksums known beforehand are not used here (%s)", checksum_name,
                             "cannot compute them" if other is None else "units were read already")
                    return
                self.checksum = other
            self.expected.update(expected)

    def has_reference(self, key: Key) -> bool:
        """Whether `key` has a checksum to be checked against (seeded, or from an earlier read)."""
        return key in self.expected

    def before_read(self, key: Key) -> None:
        """Raise CorruptUnitError at once for a unit already found bad."""
        reason = self.bad.get(key)
        if reason is not None:
            raise CorruptUnitError(reason)

    def after_read(self, key: Key, unit_bytes: torch.Tensor) -> None:
        """Check the unit just read into `unit_bytes` (contiguous CPU uint8); raise CorruptUnitError if it differs
        from its first read (or its seeded checksum), or if its first read holds NaN / infinity."""
        t0 = time.perf_counter()
        for start, end in self.padding:
            unit_bytes[start:end].zero_()
        value = self.checksum.fn(unit_bytes)
        with self._lock:
            self.checks += 1
            self.seconds += time.perf_counter() - t0
            want = self.expected.get(key)
            if want is None:
                self.expected[key] = value
        if want is None:
            if self.first_read_check is not None:
                try:
                    self.first_read_check(key, unit_bytes)
                except MoeserveError as err:
                    self._mark_bad(key, str(err))
            return
        if value != want:
            self._mark_bad(key, f"{self.name(key)}: the bytes read from {self.where(key)} differ "
                                f"from those read before ({self.checksum.name} {value:08x}, expected {want:08x}): "
                                f"the file changed or is corrupt; {self.advice(key)}")

    def _mark_bad(self, key: Key, reason: str) -> None:
        with self._lock:
            self.bad[key] = reason
        raise CorruptUnitError(reason)

    def degraded(self) -> str | None:
        """None while no unit is bad, else one line for /health."""
        bad = dict(self.bad)
        if not bad:
            return None
        first = next(iter(bad.values()))
        return f"{len(bad)} expert unit(s) failed verification; requests that need them fail: {first}"


class ReferenceScan:
    """A background thread that reads each unit without a reference checksum once, while `idle()` says the engine
    has nothing to do (it checks before each unit: a request waits for one unit's read at most), and records the
    checksum (`UnitVerifier.after_read`, NaN check included). A unit it cannot read is skipped: its misses report
    the error. `done` is set when every unit has a reference or was skipped."""

    def __init__(self, verifier: UnitVerifier, keys: Iterable[Key], unit_nbytes: int,
                 read: Callable[[Key, torch.Tensor], None], idle: Callable[[], bool]) -> None:
        self.verifier, self.keys, self.unit_nbytes, self.read, self.idle = verifier, list(keys), unit_nbytes, read, idle
        self.done = threading.Event()
        self.scanned = self.unreadable = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moeserve-verify", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, join: bool = True) -> None:
        """Stop after the unit being read (`join`: wait for that; never from the scan's own thread)."""
        self._stop.set()
        if join and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        todo = [k for k in self.keys if not self.verifier.has_reference(k)]
        if todo:
            log.info("verify: reading %d expert units (%.2f GiB) in the background while idle, to record their "
                     "checksums", len(todo), len(todo) * self.unit_nbytes / 2**30)
        t0 = time.monotonic()
        unit_bytes = torch.empty(self.unit_nbytes, dtype=torch.uint8) if todo else None
        for key in todo:
            while not self.idle():
                if self._stop.wait(0.05):  # a request is running: look again shortly
                    return
            if self._stop.is_set():
                return
            if self.verifier.has_reference(key) or key in self.verifier.bad:  # a miss read it meanwhile
                continue
            assert unit_bytes is not None
            try:
                self.read(key, unit_bytes)
            except Exception as err:  # an unreadable unit: its misses will fail with the error
                self.unreadable += 1
                if self.unreadable == 1:  # one line, not one per unit of a truncated file
                    log.warning("verify: expert %d of layer %d not readable now (%s)", key[1], key[0], err)
                continue
            try:
                self.verifier.after_read(key, unit_bytes)
            except CorruptUnitError:
                pass  # NaN on its first read: marked bad, /health says degraded
            self.scanned += 1
        if todo:
            log.info("verify: checksums of %d units recorded in %.1f s (%d unreadable)", self.scanned,
                     time.monotonic() - t0, self.unreadable)
        self.done.set()

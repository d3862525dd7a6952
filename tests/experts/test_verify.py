"""experts/verify.py and csrc/checksum.cpp: the unit checksum against its definition, the verifier's bookkeeping,
and the reference scan (pure: fake reads, no engine)."""

from __future__ import annotations

import threading
import zlib

import pytest
import torch

from moeserve.errors import CorruptUnitError
from moeserve.experts.verify import ZLIB, ReferenceScan, UnitVerifier, checksum_named, choose_checksum
from tests.kernels.ops import cpp_ops

Key = tuple[int, int]


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected 0x82F63B78, init and final xor 0xFFFFFFFF), one byte at a time."""
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    c = 0xFFFFFFFF
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def unit_checksum(data: bytes) -> int:
    """The definition in csrc/checksum.cpp: CRC-32C of 4 stripes, then CRC-32C of their 4 CRCs (little-endian)."""
    stripe = (len(data) // 32) * 8
    parts = [data[:stripe], data[stripe : 2 * stripe], data[2 * stripe : 3 * stripe], data[3 * stripe :]]
    return crc32c(b"".join(crc32c(p).to_bytes(4, "little") for p in parts))


def test_crc32c_reference_vector() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value (RFC 3720, iSCSI)
    ops = cpp_ops()
    assert ops.crc32c(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)) == 0xE3069283


@pytest.mark.parametrize("n", [0, 1, 7, 8, 31, 32, 33, 4096 + 5, 65536 + 24])
def test_unit_checksum_matches_its_python_definition(n: int) -> None:
    ops = cpp_ops()
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert ops.unit_checksum(data) == unit_checksum(bytes(data.numpy()))


def test_unit_checksum_sees_every_single_bit_flip_of_a_small_unit() -> None:
    ops = cpp_ops()
    data = torch.randint(0, 256, (97,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    base = ops.unit_checksum(data)
    for bit in range(data.numel() * 8):
        flipped = data.clone()
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert ops.unit_checksum(flipped) != base, bit


def test_the_fallback_is_zlib_crc32_and_checksums_are_found_by_name() -> None:
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert ZLIB.fn(data) == zlib.crc32(bytes(data.numpy()))
    assert checksum_named(ZLIB.name) is ZLIB
    assert checksum_named(choose_checksum().name) is not None
    assert checksum_named("no-such-checksum") is None


def unit_of(key: Key, nbytes: int = 256) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(hash(key)))


def test_a_changed_unit_is_marked_bad_and_then_fails_before_any_read() -> None:
    verifier = UnitVerifier(choose_checksum(), lambda key: f"file-{key[0]}.safetensors")
    assert verifier.degraded() is None
    for key in [(0, 1), (0, 2)]:
        verifier.before_read(key)
        verifier.after_read(key, unit_of(key))  # the first read gives the reference
    verifier.after_read((0, 1), unit_of((0, 1)))  # the same bytes again: fine
    changed = unit_of((0, 2))
    changed[17] ^= 0x01
    with pytest.raises(CorruptUnitError, match="expert 2 of layer 0: the bytes read from file-0.safetensors"):
        verifier.after_read((0, 2), changed)
    with pytest.raises(CorruptUnitError, match="file-0.safetensors"):
        verifier.before_read((0, 2))  # fails fast from now on
    verifier.before_read((0, 1))  # the others are untouched
    assert set(verifier.bad) == {(0, 2)} and "1 expert unit(s)" in (verifier.degraded() or "")


def test_a_first_read_that_fails_its_check_marks_the_unit_bad() -> None:
    from moeserve.errors import CheckpointError

    def no_nan(key: Key, unit: torch.Tensor) -> None:
        if int(unit[0]) == 0:
            raise CheckpointError(f"expert {key[1]} of layer {key[0]} holds NaN")

    verifier = UnitVerifier(ZLIB, lambda key: "f", no_nan)
    with pytest.raises(CorruptUnitError, match="holds NaN"):
        verifier.after_read((1, 0), torch.zeros(64, dtype=torch.uint8))
    assert (1, 0) in verifier.bad


def test_the_reference_scan_reads_only_while_idle_and_records_every_readable_unit() -> None:
    keys = [(layer, e) for layer in range(2) for e in range(4)]
    verifier = UnitVerifier(choose_checksum(), lambda key: "f")
    verifier.after_read(keys[0], unit_of(keys[0]))  # read by a miss already: the scan skips it
    idle_calls: list[int] = []
    read: list[Key] = []
    lock = threading.Lock()

    def idle() -> bool:  # busy for the first 3 looks, then idle
        with lock:
            idle_calls.append(len(read))
            return len(idle_calls) > 3

    def read_unit(key: Key, out: torch.Tensor) -> None:
        with lock:
            assert len(idle_calls) > 3, "read while the engine was busy"
            read.append(key)
        if key == keys[5]:
            raise OSError("short read")
        out.copy_(unit_of(key))

    scan = ReferenceScan(verifier, keys, 256, read_unit, idle)
    scan.start()
    assert scan.done.wait(60)
    scan.stop()
    assert read == keys[1:] and scan.scanned == len(keys) - 2 and scan.unreadable == 1
    assert all(verifier.has_reference(k) for k in keys if k != keys[5]) and not verifier.has_reference(keys[5])
    changed = unit_of(keys[3])
    changed[0] ^= 0xFF
    with pytest.raises(CorruptUnitError):  # a unit no miss had read: its change is caught at the first miss
        verifier.after_read(keys[3], changed)


def test_a_stopped_scan_reads_nothing_more() -> None:
    verifier = UnitVerifier(ZLIB, lambda key: "f")
    gate = threading.Event()
    scan = ReferenceScan(verifier, [(0, e) for e in range(8)], 64, lambda key, out: out.fill_(1), gate.is_set)
    scan.start()
    scan.stop()  # while it waits for idle
    assert not scan.done.is_set() and not verifier.expected


def test_stale_bytes_in_the_alignment_gaps_never_change_a_checksum() -> None:
    """A read writes the fields only; the gaps between them keep what the slot held before (another unit). Equal
    fields must verify equal whatever the gaps hold (found on fp8-block units, whose small scale fields leave gaps)."""
    from moeserve.experts.unit import UnitLayout

    layout = UnitLayout.build([("w", torch.float8_e4m3fn, (32, 64)), ("s", torch.float32, (1, 2)),
                               ("b", torch.bfloat16, (3,))])
    gaps = layout.padding()
    assert gaps and all(a < b for a, b in gaps)
    covered = sum(f.nbytes for f in layout.fields) + sum(b - a for a, b in gaps)
    assert covered == layout.nbytes  # fields and gaps tile the unit
    verifier = UnitVerifier(choose_checksum(), lambda key: "file", padding=gaps)
    fields = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for garbage in (0, 255, 17):
        unit = fields.clone()
        for a, b in gaps:
            unit[a:b] = garbage
        verifier.after_read((0, 0), unit)  # raises on a mismatch
    unit = fields.clone()
    unit[layout.fields[1].offset] ^= 1  # a field byte: caught
    with pytest.raises(CorruptUnitError):
        verifier.after_read((0, 0), unit)

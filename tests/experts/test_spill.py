"""Spill files (units made once, read back on misses) and quantization="int8" serving offloaded misses from one.

Checks: the bytes read back are the bytes written; a second open reuses the file without making any unit; a
truncated, corrupted or stale file is detected and rebuilt (with a log line naming why); two builders at once
make every unit once; int8 offloaded through the spill equals int8 resident bit for bit, and each miss reads
the int8 unit (not the 16-bit expert) from the spill, never from the checkpoint.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.bench.checkpoints import write_tiny_checkpoint
from moeserve.errors import CorruptUnitError
from moeserve.experts import spill
from moeserve.experts.verify import UnitVerifier, choose_checksum
from tests.kernels.ops import suite_isa

KEYS = [(layer, e) for layer in (0, 1) for e in range(5)]
NBYTES = 1000  # not a multiple of the 4096-byte stride on purpose


def unit_of(key, out: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(100 * key[0] + key[1])
    out.copy_(torch.randint(0, 256, (out.numel(),), generator=g, dtype=torch.uint8))


class Maker:
    def __init__(self) -> None:
        self.made: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, key, out) -> None:
        unit_of(key, out)
        with self.lock:
            self.made.append(key)


def open_spill(root: Path, maker: Maker, fp: str = "fp1"):
    return spill.open_or_build(root, fp, KEYS, NBYTES, maker, "test units")


def test_units_read_back_are_the_units_made_and_a_second_open_makes_none(tmp_path):
    maker = Maker()
    s = open_spill(tmp_path, maker)
    assert s is not None and sorted(maker.made) == sorted(KEYS)
    got, want = torch.empty(NBYTES, dtype=torch.uint8), torch.empty(NBYTES, dtype=torch.uint8)
    for key in KEYS:
        s.read_unit(key, got)
        unit_of(key, want)
        assert torch.equal(got, want), key
    s.close()
    again = Maker()
    s2 = open_spill(tmp_path, again)
    assert s2 is not None and again.made == []
    s2.read_unit(KEYS[-1], got)
    unit_of(KEYS[-1], want)
    assert torch.equal(got, want)
    s2.close()
    assert not list(tmp_path.glob("fp1/*.tmp-*"))  # no temporary left behind


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_a_damaged_spill_is_detected_logged_and_rebuilt(tmp_path, caplog, damage):
    open_spill(tmp_path, Maker()).close()
    path = tmp_path / "fp1" / "units.bin"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-100]
    else:
        data[len(spill.MAGIC) + 20] ^= 0x01  # inside the JSON: its CRC no longer matches
    path.write_bytes(bytes(data))
    maker = Maker()
    with caplog.at_level(logging.WARNING, logger="moeserve"):
        s = open_spill(tmp_path, maker)
    assert s is not None and sorted(maker.made) == sorted(KEYS)  # rebuilt
    reason = {"truncate": "truncated", "header": "checksum"}[damage]
    assert any("unusable" in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    got, want = torch.empty(NBYTES, dtype=torch.uint8), torch.empty(NBYTES, dtype=torch.uint8)
    s.read_unit(KEYS[3], got)
    unit_of(KEYS[3], want)
    assert torch.equal(got, want)
    s.close()


def test_every_corrupted_unit_is_caught_when_read_not_sampled_at_open(tmp_path):
    """Units damaged on disk between runs: the header's per-unit checksums (with which the store's verifier is
    seeded) catch EACH of them on read, whichever they are; undamaged units read fine."""
    open_spill(tmp_path, Maker()).close()
    path = tmp_path / "fp1" / "units.bin"
    s = open_spill(tmp_path, Maker())
    offset, damaged = s.data_offset, {KEYS[1], KEYS[6], KEYS[9]}
    s.close()
    data = bytearray(path.read_bytes())
    for key in damaged:
        data[offset + KEYS.index(key) * 4096 + 500] ^= 0x04  # one bit
    path.write_bytes(bytes(data))
    s = open_spill(tmp_path, Maker())
    verifier = UnitVerifier(choose_checksum(), lambda key: str(path))
    verifier.seed(s.checksums())
    assert s.checksum_name == verifier.checksum.name
    got = torch.empty(NBYTES, dtype=torch.uint8)
    for key in KEYS:
        verifier.before_read(key)
        s.read_unit(key, got)
        if key in damaged:
            with pytest.raises(CorruptUnitError, match="units.bin"):
                verifier.after_read(key, got)
            with pytest.raises(CorruptUnitError):  # marked bad: fails at once from now on
                verifier.before_read(key)
        else:
            verifier.after_read(key, got)
    assert set(verifier.bad) == damaged
    s.close()


def test_a_spill_made_with_another_checksum_is_used_and_still_checked(tmp_path, caplog):
    """A file made where the C++ kernels were off (zlib CRC-32) opened where they are on: not rebuilt; the verifier
    takes the header's checksum, and a damaged unit is still caught. A checksum this process cannot compute: the
    file is rebuilt."""
    from moeserve import kernels
    from moeserve.experts.verify import ZLIB, Checksum

    kernels.load(suite_isa())  # this process's own checksum is then the C++ one, where it builds
    spill.open_or_build(tmp_path, "fp1", KEYS, NBYTES, Maker(), "test units", checksum=ZLIB).close()
    path = tmp_path / "fp1" / "units.bin"
    maker = Maker()
    s = open_spill(tmp_path, maker)
    assert maker.made == [] and s.checksum_name == ZLIB.name
    data = bytearray(path.read_bytes())
    data[s.data_offset + KEYS.index(KEYS[2]) * 4096 + 9] ^= 0x80
    path.write_bytes(bytes(data))
    verifier = UnitVerifier(choose_checksum(), lambda key: str(path))
    verifier.seed(s.checksums(), s.checksum_name)
    assert verifier.checksum.name == ZLIB.name
    got = torch.empty(NBYTES, dtype=torch.uint8)
    for key in KEYS:
        s.read_unit(key, got)
        if key == KEYS[2]:
            with pytest.raises(CorruptUnitError):
                verifier.after_read(key, got)
        else:
            verifier.after_read(key, got)
    s.close()
    spill.open_or_build(tmp_path, "fp2", KEYS, NBYTES, Maker(), "test units",
                        checksum=Checksum("made-up", ZLIB.fn)).close()
    maker = Maker()
    with caplog.at_level(logging.WARNING, logger="moeserve"):
        s = open_spill(tmp_path, maker, "fp2")
    assert sorted(maker.made) == sorted(KEYS) and s.checksum_name == choose_checksum().name
    assert any("made-up cannot be computed here" in r.getMessage() for r in caplog.records)
    s.close()


def test_fingerprint_changes_with_the_checkpoint_files_and_the_recipe(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x" * 10)
    a = spill.fingerprint([f], "int8 v1")
    assert spill.fingerprint([f], "int8 v1") == a
    assert spill.fingerprint([f], "int8 v2") != a
    f.write_bytes(b"x" * 11)  # another checkpoint file: a stale spill is never used
    assert spill.fingerprint([f], "int8 v1") != a


def test_two_builders_at_once_make_every_unit_once(tmp_path):
    maker = Maker()
    spills = []
    threads = [threading.Thread(target=lambda: spills.append(open_spill(tmp_path, maker))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(spills) == 2 and all(s is not None for s in spills)
    assert sorted(maker.made) == sorted(KEYS)
    for s in spills:
        s.close()


PROMPTS = [[5, 9, 33], [17, 250, 33, 4, 8, 120, 64, 2, 77, 45, 13, 200]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def generate(folder: Path, **settings):
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", quantization="int8", **settings)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    return llm, [(o.token_ids, [{t: e.logprob for t, e in lp.items()} for lp in o.logprobs]) for o in outs]


def test_int8_offloaded_from_the_spill_equals_int8_resident_and_reads_int8_units(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "qwen3", "qwen3_moe", "bfloat16")
    _, resident = generate(folder, int8_cache_dir=str(tmp_path / "spill"))
    llm, offloaded = generate(folder, int8_cache_dir=str(tmp_path / "spill"), expert_cache_gb=1e-9)
    assert offloaded == resident  # token ids and logprobs, exactly
    store = llm.engine.model.store
    assert list((tmp_path / "spill").glob("*/units.bin")) and "spill" in store.describe()
    assert store.stats.misses > 0
    # Every miss read one int8 unit from the spill file: about half of what the 16-bit expert takes on disk.
    assert store.stats.bytes_from_disk == store.stats.misses * store.unit_nbytes
    assert store.unit_nbytes < 0.6 * store.source.dense_source.stored_nbytes
    before = llm.engine.checkpoint.reader.bytes_read
    llm.generate([{"prompt_token_ids": [7, 8, 9]}], PARAMS)
    assert llm.engine.checkpoint.reader.bytes_read == before  # misses never touch the checkpoint now
    # With the spill off, misses quantize the 16-bit expert again: the same bits, twice the bytes read.
    llm_off, off = generate(folder, int8_cache_dir="off", expert_cache_gb=1e-9)
    assert off == resident and "quantize" in llm_off.engine.model.store.describe()


def test_an_engine_never_answers_from_corrupted_spill_units(tmp_path):
    """The tester's case: units zeroed in the spill file between two runs. The second engine opens the file (its
    header is intact), and the first miss of a zeroed unit fails naming units.bin: no garbage answer."""
    from moeserve.errors import ExpertLoadError

    folder = write_tiny_checkpoint(tmp_path / "qwen3", "qwen3_moe", "bfloat16")
    llm, _ = generate(folder, int8_cache_dir=str(tmp_path / "spill"), expert_cache_gb=1e-9)
    store = llm.engine.model.store
    path, (offset, stride, nbytes, n) = store.source.spill.path, (store.source.spill.data_offset,
                                                                  store.source.spill.stride, store.unit_nbytes,
                                                                  len(store.source.spill.keys))
    llm.engine.close()
    data = bytearray(path.read_bytes())
    for i in range(n - 3):  # all but 3 units zeroed
        data[offset + i * stride : offset + i * stride + nbytes] = bytes(nbytes)
    path.write_bytes(bytes(data))
    with pytest.raises(ExpertLoadError, match="units.bin.*delete it and restart"):
        generate(folder, int8_cache_dir=str(tmp_path / "spill"), expert_cache_gb=1e-9)

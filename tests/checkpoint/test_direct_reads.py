"""Scattered reads (expert misses) through O_DIRECT give exactly the bytes of the page-cache path, for ranges at
any alignment, and fall back to the page cache where O_DIRECT is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from moeserve.checkpoint.safetensors_file import FileReader


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    raw = os.urandom(3 * 4096 * 7 + 123)
    path = tmp_path / "blob.bin"
    path.write_bytes(raw)
    return path, raw


@pytest.mark.parametrize("offset,sizes", [(0, [4096]), (1, [100, 5000]), (4095, [8193]), (12345, [7, 9, 4096 * 3]),
                                          (3 * 4096 * 7 + 123 - 50, [50])])
def test_direct_equals_page_cache(data_file, offset, sizes):
    path, raw = data_file
    direct, cached = FileReader(direct=True), FileReader(direct=False)
    try:
        for reader in (direct, cached):
            outs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
            reader.read_run(path, offset, outs, "blob")
            assert b"".join(bytes(o.numpy()) for o in outs) == raw[offset : offset + sum(sizes)]
            assert reader.bytes_read == sum(sizes)
        if hasattr(os, "O_DIRECT") and direct._direct_fds.get(path) is None:
            pytest.skip("this file system refuses O_DIRECT: only the fallback ran")
    finally:
        direct.close()
        cached.close()


def test_refused_direct_falls_back(data_file):
    path, raw = data_file
    reader = FileReader(direct=True)
    reader._direct_fds[path] = None  # as after open() refused O_DIRECT
    out = torch.empty(1000, dtype=torch.uint8)
    reader.read_run(path, 17, [out], "blob")
    assert bytes(out.numpy()) == raw[17:1017]
    reader.close()


def _reverse_into(dst: torch.Tensor, stored: torch.Tensor) -> None:  # a placer that permutes: bytes reversed
    dst.copy_(stored.flip(0))


@pytest.mark.parametrize("direct", [True, False])
def test_placed_pieces_get_their_stored_bytes_through_the_placer(data_file, direct):
    """`place`: a piece with a placer is written by it from exactly its stored bytes; the others are copied."""
    path, raw = data_file
    reader = FileReader(direct=direct)
    try:
        offset, sizes = 4000, [300, 8192, 77]
        outs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        reader.read_run(path, offset, outs, "blob", [None, _reverse_into, _reverse_into])
        assert bytes(outs[0].numpy()) == raw[offset : offset + 300]
        assert bytes(outs[1].numpy()) == raw[offset + 300 : offset + 300 + 8192][::-1]
        assert bytes(outs[2].numpy()) == raw[offset + 8492 : offset + 8492 + 77][::-1]
        assert reader.bytes_read == sum(sizes)
    finally:
        reader.close()

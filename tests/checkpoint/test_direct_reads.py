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

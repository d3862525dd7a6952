"""RSS measurement and the bandwidth probes give plausible, self-consistent numbers."""

from __future__ import annotations

import torch

from moeserve.checkpoint.folder import open_checkpoint
from moeserve.memory.bandwidth import disk_read_bandwidth, ram_copy_bandwidth
from moeserve.memory.rss import current_rss_bytes, peak_rss_bytes


def test_peak_rss_is_a_high_water_mark():
    before = peak_rss_bytes()
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # touched: 64 MiB resident
    assert current_rss_bytes() <= peak_rss_bytes()
    assert peak_rss_bytes() >= before
    assert peak_rss_bytes() >= 64 * 2**20
    del block


def test_probes_measure_positive_bandwidth(tiny_checkpoint):
    ram = ram_copy_bandwidth(nbytes=8 * 2**20, repeats=2)
    assert ram.bytes_per_s > 0 and ram.nbytes == 8 * 2**20
    ckpt = open_checkpoint(tiny_checkpoint("qwen3_moe"))
    refs = [r for n, r in ckpt.tensors.items() if ".experts." in n]
    disk = disk_read_bandwidth(refs, max_bytes=64 * 1024)
    assert disk is not None and disk.bytes_per_s > 0 and 64 * 1024 <= disk.nbytes < 64 * 1024 + refs[0].nbytes
    assert disk_read_bandwidth([]) is None

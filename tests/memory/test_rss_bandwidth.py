"""RSS measurement and the bandwidth probes give plausible, self-consistent numbers."""

from __future__ import annotations

import torch

from moeserve.checkpoint.folder import open_checkpoint
from moeserve.memory.probes import ram_copy_bandwidth, tensor_read_bandwidth
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
    disk = tensor_read_bandwidth(refs, max_bytes=64 * 1024)
    assert disk is not None and disk.bytes_per_s > 0 and 64 * 1024 <= disk.nbytes < 64 * 1024 + refs[0].nbytes
    assert tensor_read_bandwidth([]) is None


def test_the_host_to_device_probe_falls_back_to_pageable_copies_and_says_so():
    """Where pinning is unavailable (WSL, a locked-memory limit) the probe does not crash: it copies from pageable
    memory with blocking copies, as the engine will, and its note says why. The device ops are the fake fast tier's."""
    from moeserve.memory.probes import host_to_device_bandwidth
    from tests.experts.async_device import AsyncFakeOps

    for limit, note in ((None, ""), (0, "pinned memory unavailable (fake: cannot pin 1048576 bytes (limit 0)): "
                                        "pageable, blocking copies")):
        ops = AsyncFakeOps(0, pin_limit_bytes=limit)
        try:
            bw = host_to_device_bandwidth(ops, torch.device("cpu"), nbytes=2**20)
        finally:
            ops.close()
        assert bw.bytes_per_s > 0 and bw.nbytes == 2**20 and bw.note == note
        assert ops.violations == []  # never a non_blocking copy from pageable memory
        assert (ops.async_copies, ops.sync_copies) == ((2, 0) if limit is None else (0, 2))

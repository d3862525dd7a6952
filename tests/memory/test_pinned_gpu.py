"""On CUDA (skipped without one; scripts/gpu_acceptance.sh runs the gpu marker): the host tier's chunks are
really pinned, torch's pinned allocator adds nothing to their bytes (it rounds a single odd-sized request up to a
power of two, shown beside), and close() gives the pinned memory back to the OS."""

from __future__ import annotations

import pytest
import torch

from moeserve.memory.chunks import plan_chunks
from moeserve.memory.pinned import ChunkedHostPool, _host_cache_release, empty_host_cache

pytestmark = pytest.mark.gpu
MiB = 2**20


def pinned_bytes() -> int:
    """Bytes of pinned blocks torch's host allocator owns (in use and cached), as requested from CUDA."""
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def test_chunks_are_pinned_unrounded_and_released_on_close():
    from moeserve.memory.device import CudaOps

    device = torch.device("cuda")
    torch.cuda.init()
    if _host_cache_release() is None:  # torch 2.11 (seen on an H200): nothing gives cached pinned blocks back
        pytest.skip(f"torch {torch.__version__} has no call that empties its pinned-memory cache")
    empty_host_cache()
    ops = CudaOps(device)
    # the problem the chunks avoid: one 96 MiB request takes 128 MiB
    before = pinned_bytes()
    odd = torch.empty(96 * MiB, dtype=torch.uint8, pin_memory=True)
    assert pinned_bytes() - before == 128 * MiB
    del odd
    empty_host_cache()
    assert pinned_bytes() == before

    plan = plan_chunks(10, 60 * MiB)  # 2 x 256 MiB of 4 units + 128 MiB for the last 2
    pool = ChunkedHostPool(plan, ops.empty_pinned)
    assert pool.all_pinned and all(chunk.is_pinned() for chunk in pool.chunks)
    assert pinned_bytes() - before == plan.nbytes == 640 * MiB  # nothing rounded beyond the plan
    slot = pool.slots[9]
    slot.fill_(7)
    dst = torch.empty(slot.numel(), dtype=torch.uint8, device=device)
    event = ops.copy(dst, slot, non_blocking=True)
    ops.synchronize(event)
    assert int(dst.min()) == int(dst.max()) == 7
    del slot, event
    pool.close()
    assert pinned_bytes() == before  # freed and taken out of torch's cache, not kept until exit

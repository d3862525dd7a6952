"""Huge-page host buffers: right size, aligned, writable, same contents; small ones stay ordinary tensors."""

from __future__ import annotations

import torch

from moeserve.memory.hugepages import HUGE_PAGE_BYTES, huge_page_bytes, on_huge_pages, thp_mode


def test_large_buffer_is_aligned_and_advised_where_thp_allows():
    n = 3 * HUGE_PAGE_BYTES + 12345
    buf, huge = huge_page_bytes(n)
    assert buf.dtype == torch.uint8 and buf.numel() == n and buf.is_contiguous()
    assert huge == (thp_mode() in ("always", "madvise"))
    if huge:
        assert buf.data_ptr() % HUGE_PAGE_BYTES == 0
    buf.fill_(7)
    assert int(buf[-1]) == 7 and int(buf.sum()) == 7 * n


def test_small_buffer_is_a_plain_tensor():
    buf, huge = huge_page_bytes(HUGE_PAGE_BYTES - 1)
    assert not huge and buf.numel() == HUGE_PAGE_BYTES - 1


def test_on_huge_pages_copies_contents_shape_and_dtype():
    w = torch.randn(1024, 1536).bfloat16()  # 3 MiB
    moved = on_huge_pages(w)
    assert moved.dtype == w.dtype and moved.shape == w.shape and torch.equal(moved, w)
    small = torch.randn(4, 4)
    assert on_huge_pages(small) is small

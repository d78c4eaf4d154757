"""After a large body the gateway gives memory back, once, off the loop; small requests never trigger it."""

from __future__ import annotations

from extproc.server.heap import LARGE_BODY_BYTES, HeapTrimmer


async def test_a_trim_follows_a_large_body_once_and_never_a_small_one():
    calls: list[int] = []
    heap = HeapTrimmer(trim=lambda pad: calls.append(pad) or 1)
    heap.saw_body(LARGE_BODY_BYTES - 1)
    await heap.trim_if_due()
    assert calls == []
    heap.saw_body(LARGE_BODY_BYTES)
    heap.saw_body(8 * LARGE_BODY_BYTES)
    await heap.trim_if_due()
    await heap.trim_if_due()  # nothing new since
    assert calls == [0] and heap.trims == 1


async def test_without_malloc_trim_nothing_happens():
    heap = HeapTrimmer(trim=None)
    heap._trim = None  # as on musl, where libc has no malloc_trim (None above means "find it")
    heap.saw_body(8 * LARGE_BODY_BYTES)
    await heap.trim_if_due()
    assert heap.trims == 0

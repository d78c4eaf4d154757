"""Giving the memory of large request bodies back to the system once they are gone.

A buffered 7 MiB body passes through several buffers (gRPC's message, the protobuf, the copy sent
to the parser process). Measured (`extproc bench memory --large-bodies`, docs/benchmarks.md): after
80 such bodies the gateway held 180-330 MiB more than idle, for as long as it stayed idle. Two
causes: grpc.aio leaves each call's method-lookup closure in a reference cycle (its
`_find_method_handler` scope and `_HandlerCallDetails`) that keeps the call's buffers alive until a
full collection, which an idle gateway does not get to (a collection brought 242 MiB back to 123);
and glibc keeps freed memory in its arenas (`malloc_trim` brought 455 MiB back to 197). So, after a
large body and at most once a second: a full collection (the start's objects frozen out of it, so
it takes well under a millisecond), then `malloc_trim(0)` in a thread. Small requests never pay for
it. The trim is a no-op where libc has no malloc_trim (musl).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
from collections.abc import Callable

LARGE_BODY_BYTES = 1 << 20  # a body this large leaves enough behind to be worth a trim


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    def __init__(self, trim: Callable[[int], int] | None = None) -> None:
        self._trim = trim if trim is not None else _malloc_trim()
        self._due = False
        self.trims = 0

    @staticmethod
    def freeze_start() -> None:
        """The ~80,000 objects of the start (modules, config, strategies) out of the collector's way:
        a full collection then takes well under a millisecond instead of ~40 ms."""
        gc.collect()
        gc.freeze()

    def saw_body(self, size: int) -> None:
        """An ext_proc stream that handled a body of `size` bytes ended."""
        if size >= LARGE_BODY_BYTES:
            self._due = True

    async def trim_if_due(self) -> None:
        if not self._due or self._trim is None:
            return
        self._due = False  # bodies arriving during the trim make it due again
        gc.collect()
        await asyncio.to_thread(self._trim, 0)
        self.trims += 1

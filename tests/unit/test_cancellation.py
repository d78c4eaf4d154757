"""raise_if_cancelled: a cancel that Python 3.11's wait_for swallowed still stops a loop."""

from __future__ import annotations

import asyncio
import sys

import pytest

from extproc.cancellation import raise_if_cancelled


async def _loop_like_redis_sync(futures: list[asyncio.Future[None]], check: bool) -> None:
    loop = asyncio.get_running_loop()
    while True:
        fut = loop.create_future()
        futures.append(fut)
        await asyncio.wait_for(fut, 10)  # what redis-py wraps around every socket write
        if check:
            raise_if_cancelled()
        await asyncio.sleep(0.01)


async def _cancel_as_the_write_completes(check: bool) -> asyncio.Task[None]:
    futures: list[asyncio.Future[None]] = []
    task = asyncio.create_task(_loop_like_redis_sync(futures, check))
    await asyncio.sleep(0)
    futures[-1].set_result(None)  # the write completes ...
    task.cancel()                 # ... in the same loop turn as the shutdown's cancel
    await asyncio.wait({task}, timeout=1)
    return task


async def test_the_loop_stops_although_wait_for_swallowed_the_cancel():
    task = await _cancel_as_the_write_completes(check=True)
    assert task.done() and task.cancelled()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's wait_for no longer swallows the cancel")
async def test_without_it_the_loop_would_carry_on_on_python_3_11():
    task = await _cancel_as_the_write_completes(check=False)
    assert not task.done()  # the failure this module exists for
    task.cancel()
    await asyncio.wait({task}, timeout=1)
    assert task.cancelled()

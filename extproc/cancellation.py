"""A cancel that reached a task but was lost on the way, raised again.

Python 3.11's `asyncio.wait_for` returns its result when the awaited future completes in the same loop
turn as a cancel of the calling task, and the cancel is gone (CPython gh-86296, fixed in 3.12). redis-py
wraps every socket write in `wait_for`, so a background loop cancelled while it talks to Redis can
carry on as if nothing happened, and a shutdown that waits for it waits forever. `Task.cancelling()`
still counts the request, so a long-running loop calls `raise_if_cancelled()` once per turn.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    """In a task's own top-level loop: stop now if a cancel was requested and never delivered."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


__all__ = ["raise_if_cancelled"]

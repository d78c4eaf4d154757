"""Reads a model's request-trace windows from Redis (the keys extproc.tracing and AIBrix's gateway write)."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from extproc import redis_connect
from extproc.optimizer.workload import TraceWindow, WorkloadError, parse_trace
from extproc.tracing import INTERVAL_SEC, trace_key

log = logging.getLogger(__name__)


def window_ends(now: float, window_seconds: float, interval: int = INTERVAL_SEC) -> list[int]:
    """Ends of the windows inside (now − window, now], newest first."""
    last = math.floor(now / interval) * interval
    return [e for e in range(last, math.floor(now - window_seconds), -interval) if e > now - window_seconds]


async def read_windows(redis: Any, model: str, now: float, window_seconds: float) -> list[TraceWindow]:
    """Every window in (now - window_seconds, now], re-read each time: a late or rewritten window is seen
    too. The service reads READ_SPAN window lengths (48 keys at 240 s); a malformed window is logged and
    skipped."""
    ends = window_ends(now, window_seconds)
    if not ends:
        return []
    # Key by key in one pipeline, not MGET: on a Redis Cluster AIBrix's keys lie on several shards.
    pipe = redis_connect.pipeline(redis)
    for e in ends:
        pipe.get(trace_key(model, e))
    values = await pipe.execute()
    out = []
    for end, raw in zip(ends, values):
        if raw is None:
            continue
        try:
            out.append(parse_trace(end, json.loads(raw)))
        except (ValueError, WorkloadError) as e:
            log.warning("request trace %s skipped: %s", trace_key(model, end), e)
    return out

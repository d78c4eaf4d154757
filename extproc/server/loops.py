"""The gateway's background loops: engine metrics and health, capacity refresh, expiry, Redis sync.

Each is a supervised task: an exception is logged and the loop goes on, so a background failure
degrades a signal and never a request. Nothing here is awaited on the request path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import Gauge

from extproc.cancellation import raise_if_cancelled
from extproc.server.gateway import Gateway
from extproc.server.heap import HeapTrimmer
from extproc.telemetry.scraper import HealthProber, MetricsScraper

log = logging.getLogger(__name__)
EXPIRY_INTERVAL_SECONDS = 10.0
BUSY_SAMPLE_SECONDS = 0.1  # as often as the Redis sync, so every gateway sees the same busy time
LAG_PROBE_SECONDS = 0.05
HEAP_TRIM_SECONDS = 1.0


async def watch_loop_lag(gauge: Gauge) -> None:
    """How late the event loop wakes up: anything that blocks it (a long parse) shows here."""
    loop = asyncio.get_running_loop()
    worst = 0.0
    while True:
        start = loop.time()
        await asyncio.sleep(LAG_PROBE_SECONDS)
        lag = loop.time() - start - LAG_PROBE_SECONDS
        if lag > worst:
            worst = lag
            gauge.set(lag)


async def every(interval: Callable[[], float], step: Callable[[], None | Awaitable[None]], name: str) -> None:
    while True:
        try:
            result = step()
            if asyncio.iscoroutine(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed; retrying", name)
        raise_if_cancelled()  # a step that talks to Redis can swallow a cancel (extproc/cancellation.py)
        await asyncio.sleep(interval())


def start(gateway: Gateway, scraper: MetricsScraper, prober: HealthProber,
          heap: HeapTrimmer | None = None) -> list[asyncio.Task]:
    scraper.on_sample = gateway.reconcile

    tasks = [
        # `lambda`, not `gateway.pool.all_pods`: a reload replaces the pool, and the loops must follow
        asyncio.create_task(scraper.run(lambda: gateway.pool.all_pods(),
                                        gateway.config.metrics_refresh_seconds,
                                        gateway.observe_scrape), name="metrics"),
        asyncio.create_task(prober.run(lambda: gateway.pool.all_pods()), name="probes"),
        asyncio.create_task(every(lambda: gateway.config.metrics_refresh_seconds, gateway.refresh,
                                  "capacity refresh"), name="refresh"),
        asyncio.create_task(every(lambda: BUSY_SAMPLE_SECONDS, gateway.sample_busy, "busy sampling"),
                            name="busy"),
        asyncio.create_task(every(lambda: EXPIRY_INTERVAL_SECONDS, gateway.expire, "expiry"), name="expiry"),
        # records of this gateway's requests that reached another replica (popped at each Redis sync)
        asyncio.create_task(every(lambda: BUSY_SAMPLE_SECONDS, gateway.release_forwarded, "peer records"),
                            name="peer-records"),
        asyncio.create_task(watch_loop_lag(Gauge(
            "extproc_event_loop_max_lag_seconds", "Largest delay seen in waking the event loop",
            registry=gateway.registry)), name="loop-lag"),
    ]
    if heap is not None:  # what large bodies left in malloc's arenas, back to the system
        tasks.append(asyncio.create_task(every(lambda: HEAP_TRIM_SECONDS, heap.trim_if_due, "heap trim"),
                                         name="heap-trim"))
    tasks.append(asyncio.create_task(gateway.shared.run(), name="shared-state"))  # Redis: its sync loop
    return tasks

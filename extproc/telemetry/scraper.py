"""The I/O shell of telemetry: scrape every pod's /metrics, probe ejected pods. Never raises out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from extproc.pool.pod import Pod, PodKey
from extproc.telemetry.engine_metrics import EngineSample, MetricsParseError, parse_metrics
from extproc.telemetry.health import PodHealth

log = logging.getLogger(__name__)
MAX_METRICS_BYTES = 4 << 20  # an engine's /metrics is tens of KB; refuse to buffer a runaway one


@dataclass(slots=True)
class _Backoff:
    failures: int = 0
    next_try: float = 0.0


def _refused(exc: BaseException) -> bool:
    """The engine is not there at all (as opposed to slow or confused)."""
    return isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError | ConnectionResetError
                      | aiohttp.ServerDisconnectedError)


class MetricsScraper:
    def __init__(self, registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic,
                 timeout: float = 0.5, stale_after: float = 3.0, max_backoff: float = 2.0) -> None:
        self.clock = clock
        self.timeout = timeout
        self.stale_after = stale_after
        self.max_backoff = max_backoff
        self._samples: dict[PodKey, EngineSample] = {}
        # Called with each sample as it arrives: the in-flight reconciliation compares the engine's
        # count with the requests open at that moment, not a second later (extproc/state/reconcile.py).
        self.on_sample: Callable[[PodKey, EngineSample], object] | None = None
        self._backoff: dict[PodKey, _Backoff] = {}
        self._session: aiohttp.ClientSession | None = None
        self.errors = Counter("extproc_metrics_scrape_errors", "Failed engine /metrics scrapes",
                              ["model", "pod"], registry=registry)

    def sample(self, key: PodKey, now: float) -> EngineSample | None:
        s = self._samples.get(key)
        if s is None or now - s.at > self.stale_after:
            return None
        return s

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                connector=aiohttp.TCPConnector(limit=64, keepalive_timeout=30))
        return self._session

    async def _scrape(self, pod: Pod) -> tuple[bool, bool]:
        """(ok, connect refused)"""
        sent = self.clock()
        try:
            async with self._http().get(pod.metrics_url) as resp:
                if resp.status != 200:
                    raise MetricsParseError(f"HTTP {resp.status}")
                raw = await resp.content.read(MAX_METRICS_BYTES + 1)
                if len(raw) > MAX_METRICS_BYTES:
                    raise MetricsParseError("metrics body too large")
            sample = parse_metrics(raw.decode("utf-8", "replace"), pod.engine, self.clock(), sent)
        except Exception as exc:  # timeouts, refusals, garbage: a stale signal, never an error upstream
            self.errors.labels(pod.model, pod.name).inc()
            self._samples.pop(pod.key, None)
            return False, _refused(exc)
        self._samples[pod.key] = sample
        if self.on_sample is not None:
            try:
                self.on_sample(pod.key, sample)
            except Exception:
                log.exception("handling the metrics of %s failed", pod.name)
        return True, False

    async def scrape_once(self, pods: Sequence[Pod]) -> dict[PodKey, tuple[bool, bool]]:
        """Scrape every pod not in backoff, concurrently; returns (ok, refused) per scraped pod."""
        now = self.clock()
        due = [p for p in pods if self._backoff.get(p.key, _Backoff()).next_try <= now]
        results = await asyncio.gather(*(self._scrape(p) for p in due))
        out = {}
        for pod, (ok, refused) in zip(due, results):
            b = self._backoff.setdefault(pod.key, _Backoff())
            if ok:
                if b.failures:
                    log.info("metrics of %s answer again", pod.name)
                b.failures, b.next_try = 0, 0.0
            else:
                if b.failures == 0:
                    log.warning("metrics of %s (%s) failing; retrying with backoff", pod.name, pod.metrics_url)
                b.failures += 1
                b.next_try = now + min(self.max_backoff, 0.5 * 2 ** (b.failures - 1))
            out[pod.key] = (ok, refused)
        return out

    async def run(self, pods: Callable[[], Sequence[Pod]], interval: float = 1.0,
                  on_result: Callable[[PodKey, bool, bool], None] | None = None) -> None:
        while True:
            try:
                for key, (ok, refused) in (await self.scrape_once(pods())).items():
                    if on_result is not None:
                        on_result(key, ok, refused)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("metrics scrape round failed")
            await asyncio.sleep(interval)

    def forget(self, live: Iterable[PodKey]) -> None:
        live = set(live)
        for table in (self._samples, self._backoff):
            for key in [k for k in table if k not in live]:
                del table[key]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class HealthProber:
    """Probes ejected pods (GET /health) on their backoff schedule and reports to PodHealth."""

    def __init__(self, health: PodHealth, clock: Callable[[], float] = time.monotonic,
                 timeout: float = 0.5, interval: float = 0.25) -> None:
        self.health = health
        self.clock = clock
        self.timeout = timeout
        self.interval = interval
        self._session: aiohttp.ClientSession | None = None

    async def _probe(self, pod: Pod) -> bool:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        try:
            async with self._session.get(f"http://{pod.address}/health") as resp:
                return resp.status == 200
        except Exception:
            return False

    async def probe_once(self, pods: Sequence[Pod]) -> None:
        due = set(self.health.due_probes(self.clock()))
        targets = [p for p in pods if p.key in due]
        for pod, ok in zip(targets, await asyncio.gather(*(self._probe(p) for p in targets))):
            if ok:
                log.info("pod %s answers again: back in routing", pod.name)
            self.health.probe_result(pod.key, ok, self.clock())

    async def run(self, pods: Callable[[], Sequence[Pod]]) -> None:
        while True:
            try:
                await self.probe_once(pods())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("health probes failed")
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

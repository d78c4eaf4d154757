"""`extproc serve`: the ext_proc gRPC server, health service, admin HTTP, config reload, drain."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2_grpc
from grpc_health.v1 import health, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from extproc import config as config_mod
from extproc import die_with_parent, environment
from extproc.envoy_contract import ENVOY_BUFFER_BYTES
from extproc.pool.info import PodInfoCollector
from extproc.ratelimit import RateLimiter
from extproc.ratelimit.redis_store import RedisStore
from extproc.ratelimit.worker_store import WorkerBudgets
from extproc.routing.framework import waitings
from extproc.server import loops, processor
from extproc.server.access_log import AccessLogService
from extproc.server.admin import admin_app
from extproc.server.discovery import start_discovery
from extproc.server.gateway import Gateway
from extproc.server.heap import HeapTrimmer
from extproc.server.inference_metrics import InferencePoolCollector, ObjectiveMetrics
from extproc.server.otel import from_env as otel_from_env
from extproc.server.processor import Processor, parse_body
from extproc.server.serving import REFRESH_SECONDS, HealthServices
from extproc.server.supervisor import WorkerSpec
from extproc.server.tls import ReloadingCredentials, TlsError, TlsSettings
from extproc.server.traces import run_tracing
from extproc.sharing.shared import LocalState, SharedState
from extproc.sharing.workers import WorkerState
from extproc.state.accounting import Accounting
from extproc.telemetry.health import PodHealth
from extproc.telemetry.scraper import HealthProber, MetricsScraper

if TYPE_CHECKING:
    from extproc.redis_connect import RedisTarget
    from extproc.server.otel import RequestSpans

log = logging.getLogger(__name__)

RELOAD_INTERVAL_SECONDS = 1.0
ACCESS_LOG_GRACE_SECONDS = 0.2  # last batched access-log records (Envoy flushes every 20 ms)
ADMIN_SHUTDOWN_SECONDS = 1.0  # admin handlers (metrics, health) are short: do not hold up a SIGTERM
SHUTDOWN_GRACE_SECONDS = 10.0  # after the drain timeout: longer than this, the shutdown has hung
MAX_MESSAGE_BYTES = ENVOY_BUFFER_BYTES + (1 << 20)  # the body plus headers and framing
MAX_PENDING_CALLS = 10_000  # calls received, not yet picked up: Envoy's max_connections (one per request)


class ConfigWatcher:
    """Polls the config file; a valid change is applied, an invalid one is logged and ignored.

    A change is applied once the file has held still for one poll: `cat > gateway.yaml` writes in
    pieces, and a prefix of a YAML file is often valid YAML with fewer pods."""

    def __init__(self, path: Path, gateway: Gateway, registry: CollectorRegistry | None = None,
                 overlay: Callable[[config_mod.Config], config_mod.Config] | None = None) -> None:
        self._path = path
        self._gateway = gateway
        self._overlay = overlay or (lambda c: c)  # Kubernetes discovery adds its pods to the file's
        self._seen = self._stamp()
        self._pending: tuple[int, int] | None = None
        self.rejected = Counter("extproc_config_reload_errors_total",
                                "Config changes refused (the previous config keeps serving)",
                                registry=registry)

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = self._path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def check(self) -> bool:
        stamp = self._stamp()
        if stamp == self._seen or stamp is None:
            self._pending = None
            return False
        if stamp != self._pending:  # changed since the last poll: wait until it holds still
            self._pending = stamp
            return False
        self._seen, self._pending = stamp, None
        try:
            new = config_mod.load(self._path)
            self._gateway.apply(self._overlay(new))
        except config_mod.ConfigError as exc:
            self.rejected.inc()
            log.error("config %s rejected, keeping the previous one: %s", self._path, exc)
            return False
        log.info("config %s reloaded: %d models, %d pods", self._path, len(new.models), len(new.pods))
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_INTERVAL_SECONDS)
            try:
                self.check()
                self._gateway.api_keys.reload_if_changed()
            except Exception:  # the watcher must outlive any surprise
                log.exception("config watch failed")


@dataclass(slots=True, eq=False)
class Assembly:
    """One `extproc serve` process's parts, wired together (`assemble`): nothing bound, nothing started."""

    path: Path
    config: config_mod.Config
    redis_url: str | None  # resolved by the loader (EXTPROC_REDIS_URL, redis.url, REDIS_HOST ...)
    redis: RedisTarget | str | None  # how to reach it: one instance, a cluster, a sentinel
    gateway: Gateway
    shared: SharedState
    scraper: MetricsScraper
    prober: HealthProber
    limiter: RateLimiter
    limit_store: RedisStore | None
    parser_pool: ProcessPoolExecutor
    heap: HeapTrimmer
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    serving: bool = False  # the admin port's answer: from the start until the drain begins


@dataclass(slots=True, eq=False)
class Running:
    """What `start` set going, for `drain` to stop."""

    health_services: HealthServices
    admin: web.AppRunner
    watcher: asyncio.Task
    background: list[asyncio.Task]
    otel: tuple[RequestSpans, Any] | None


async def run_server(config_path: str, *, port: int, admin_port: int, host: str = "127.0.0.1",
                     admin_host: str = "127.0.0.1", stop: asyncio.Event | None = None,
                     tls: TlsSettings | None = None, worker: WorkerSpec | None = None) -> None:
    parts = assemble(Path(config_path), worker)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await start(parts, port=port, admin_port=admin_port, host=host, admin_host=admin_host,
                          tls=tls, worker=worker)
    await stop.wait()
    await drain(parts, running)


def assemble(path: Path, worker: WorkerSpec | None = None) -> Assembly:
    """The config loaded (ConfigError: refused) and every part built: shared state, scraping, rate limits,
    the gateway and its collectors, the body parser's worker process, the gRPC services."""
    config = config_mod.load(path)
    registry = CollectorRegistry()
    redis_url = config.redis_url
    redis = config.redis_target or redis_url
    shared: SharedState
    if redis_url:
        from extproc.sharing.redis_sync import RedisState  # the Redis client loads only when used

        sync = config.redis_sync
        shared = RedisState(redis, config.redis_instance, sync_interval=sync.interval_seconds,
                            heartbeat_interval=sync.heartbeat_seconds, gateway_ttl=sync.gateway_ttl,
                            op_timeout=sync.timeout_seconds, aibrix_snapshots=sync.aibrix_rows,
                            registry=registry)
    elif worker is not None:  # one of `serve --workers N`: counts shared with the others in memory
        shared = WorkerState(worker.segment_fd, worker.index)
    else:
        shared = LocalState()
    scraper = MetricsScraper(registry, timeout=config.metrics_timeout_seconds)
    accounting = Accounting(shared, health=PodHealth(), samples=scraper.sample)
    # Rate-limit budgets shared through Redis when there is one (turned on and off by reloads)
    limit_store = (RedisStore(redis, config.rate_limits.redis_timeout_s)
                   if redis_url else None)
    # without Redis, the workers of `serve --workers N` share theirs in memory (N x the limit otherwise)
    limiter = RateLimiter(config.rate_limits, registry, store=limit_store,
                          local=WorkerBudgets(worker.budgets_fd) if worker is not None else None)
    gateway = Gateway(config, registry=registry, accounting=accounting, limiter=limiter)
    registry.register(PodInfoCollector(lambda: gateway.pool.all_pods()))  # GPU type etc. per pod
    # the Inference Extension's reference picker's series, for the dashboards that chart a pool's
    registry.register(InferencePoolCollector(gateway))
    gateway.add_hook(ObjectiveMetrics(registry))
    prober = HealthProber(accounting.health)
    # Long prompts are parsed in a worker process: the parser holds the GIL, a thread would not help.
    # The worker dies with the gateway, however the gateway dies (it holds its own queue's write end,
    # so it would never see the gateway go).
    parser_pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                      initializer=die_with_parent.arm, initargs=(os.getpid(),))
    parser_pool.submit(parse_body, "/", b"{}", None)  # start the worker now, not on the first long prompt

    # so_reuseport off: a second server on a taken port must fail, not silently share it.
    # The buffered request body arrives as one message: lift gRPC's 4 MiB default above Envoy's buffer.
    # Keepalive pings find a vanished Envoy, so its streams end and their in-flight counts are released.
    # gRPC cancels calls the loop has not picked up yet past 1,000 (at random up to 3,000): a burst of
    # 2,000 requests lost ~1 % to CANCELLED -> 503. Envoy's listener cap bounds what can arrive.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                                      ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
                                      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.keepalive_time_ms", 30_000),
                                      ("grpc.keepalive_timeout_ms", 10_000),
                                      ("grpc.http2.max_pings_without_data", 0),
                                      ("grpc.keepalive_permit_without_calls", 1)])
    heap = HeapTrimmer()
    processor.add_to_server(Processor(gateway, parser_pool, heap=heap), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogService(gateway), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return Assembly(path, config, redis_url, redis, gateway, shared, scraper, prober, limiter, limit_store,
                    parser_pool, heap, server, health_servicer)


async def start(parts: Assembly, *, port: int, admin_port: int, host: str = "127.0.0.1",
                admin_host: str = "127.0.0.1", tls: TlsSettings | None = None,
                worker: WorkerSpec | None = None) -> Running:
    """Bind the ext_proc port (OSError: taken), serve health, the admin port and gRPC, then start the
    background work: discovery, config reloads, scraping and probing, readiness, the rate-limit store's
    connection, the waiting strategies' refresh, traces."""
    gateway, server, redis_url, redis = parts.gateway, parts.server, parts.redis_url, parts.redis
    # TLS (mTLS with a client CA) when configured; the certificate follows its files (server/tls.py)
    bound = (server.add_secure_port(f"{host}:{port}", ReloadingCredentials(tls).server_credentials())
             if tls else server.add_insecure_port(f"{host}:{port}"))
    if bound == 0:
        raise OSError(f"cannot bind the ext_proc port {host}:{port}")
    parts.serving = True
    health_services = HealthServices(parts.health, gateway)  # the protocol's liveness, readiness
    await health_services.start()

    # shutdown_timeout: aiohttp waits up to 60 s by default for admin handlers in flight at shutdown
    admin = web.AppRunner(admin_app(gateway, lambda: parts.serving), access_log=None,
                          shutdown_timeout=ADMIN_SHUTDOWN_SECONDS)
    await admin.setup()
    if worker is not None:  # only the supervisor reads it, and serves the workers' sum on the admin port
        await web.UnixSite(admin, worker.admin_path).start()
    else:
        await web.TCPSite(admin, admin_host, admin_port).start()
    await server.start()
    discovery, overlay = start_discovery(gateway, parts.config)
    watcher = asyncio.create_task(ConfigWatcher(parts.path, gateway, gateway.registry, overlay).run())
    background = loops.start(gateway, parts.scraper, parts.prober, parts.heap)
    background.append(asyncio.create_task(loops.every(lambda: REFRESH_SECONDS, health_services.refresh,
                                                      "readiness"), name="readiness"))
    parts.heap.freeze_start()  # what the start allocated is never scanned again by the trims' collections
    if discovery is not None:
        background.append(discovery)
    if parts.limit_store is not None:  # connected before the first request needs it
        background.append(asyncio.create_task(parts.limit_store.start(), name="ratelimit-connect"))
    # what strategies that hold requests back keep fresh off the request path (the slo* family: profiles
    # from files named in routing.slo.profiles and Redis aibrix:profile_*, every 10 s; the split)
    for waiting in waitings():
        if waiting.refresh is not None:
            background.append(asyncio.create_task(waiting.refresh(gateway, redis),
                                                  name=f"{waiting.name}-profiles"))
    otel = otel_from_env(os.environ)
    if otel is not None:
        gateway.add_spans(otel[0])
    if parts.config.tracing:
        if redis_url:
            background.append(asyncio.create_task(run_tracing(gateway, redis), name="traces"))
        else:
            log.warning("%s is set but no Redis is configured: no request traces", environment.TRACING_FLAG)
    log.info("ext_proc on %s:%d, admin on http://%s:%d, strategy %s", host, port, admin_host,
             admin_port, gateway.config.default_strategy)
    return Running(health_services, admin, watcher, background, otel)


async def drain(parts: Assembly, running: Running) -> None:
    """NOT_SERVING for the drain notice, then refuse new streams and let the open ones finish (up to the
    drain timeout), then stop the background work, the clients, the parser and the admin server."""
    gateway, server = parts.gateway, parts.server
    loop = asyncio.get_running_loop()
    parts.serving = False
    log.info("draining: NOT_SERVING for %gs before refusing new streams",
             gateway.config.drain_notice_seconds)
    await running.health_services.drain()
    running.watcher.cancel()
    await asyncio.sleep(gateway.config.drain_notice_seconds)
    log.info("refusing new streams; %d open, waiting up to %gs", gateway.open_streams,
             gateway.config.drain_timeout_seconds)
    # stop() refuses new streams at once and cancels those still open after the grace (each
    # Stream.close() then releases its count). Routing streams last milliseconds; Envoy's access-log
    # stream never ends by itself, so once the routing streams are done the server stops outright.
    # Records of responses still streaming reach the next gateway process instead.
    # Past drain + grace, a shutdown that still runs is a hang: every thread's stack goes to the log
    # and the process exits, so a recurrence says where it stuck instead of waiting for a SIGKILL.
    faulthandler.dump_traceback_later(gateway.config.drain_timeout_seconds + SHUTDOWN_GRACE_SECONDS,
                                      exit=True)
    stopping = asyncio.create_task(server.stop(gateway.config.drain_timeout_seconds))
    deadline = loop.time() + gateway.config.drain_timeout_seconds
    while gateway.open_streams and loop.time() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(ACCESS_LOG_GRACE_SECONDS)
    await server.stop(None)
    await stopping
    log.info("gRPC server stopped; stopping background tasks, clients and the admin server")
    background = running.background
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    await parts.scraper.close()
    await parts.prober.close()
    await parts.limiter.close()
    await parts.shared.close()
    parts.parser_pool.shutdown(wait=False, cancel_futures=True)
    if running.otel is not None:  # the last spans out, bounded (the SDK's export timeout), off the loop
        await asyncio.to_thread(running.otel[1].shutdown)
    await running.admin.cleanup()
    faulthandler.cancel_dump_traceback_later()
    log.info("stopped; %d routed requests had no access-log record yet", len(gateway.open))


def serve(config_path: str, *, port: int, admin_port: int, host: str = "127.0.0.1",
          admin_host: str = "127.0.0.1", tls: TlsSettings | None = None, worker: WorkerSpec | None = None) -> int:
    try:
        import uvloop  # optional: faster loop when installed
        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(run_server(config_path, port=port, admin_port=admin_port, host=host,
                               admin_host=admin_host, tls=tls, worker=worker))
    except (config_mod.ConfigError, TlsError) as exc:
        log.error("%s", exc)
        return 2
    return 0

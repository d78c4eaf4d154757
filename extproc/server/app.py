"""`extproc serve`: the ext_proc gRPC server, health service, admin HTTP, config reload, drain."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc import config as config_mod
from extproc.envoy_bootstrap import BUFFER_LIMIT_BYTES
from extproc.server.admin import admin_app
from extproc.server.gateway import Gateway
from extproc.server.processor import Processor

log = logging.getLogger(__name__)

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
RELOAD_INTERVAL_SECONDS = 1.0
MAX_MESSAGE_BYTES = BUFFER_LIMIT_BYTES + (1 << 20)  # the body plus headers and framing


class ConfigWatcher:
    """Polls the config file; a valid change is applied, an invalid one is logged and ignored."""

    def __init__(self, path: Path, gateway: Gateway) -> None:
        self._path = path
        self._gateway = gateway
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = self._path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def check(self) -> bool:
        stamp = self._stamp()
        if stamp == self._seen or stamp is None:
            return False
        self._seen = stamp
        try:
            new = config_mod.load(self._path)
            self._gateway.apply(new)
        except config_mod.ConfigError as exc:
            log.error("config %s rejected, keeping the previous one: %s", self._path, exc)
            return False
        log.info("config %s reloaded: %d models, %d pods", self._path, len(new.models), len(new.pods))
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_INTERVAL_SECONDS)
            try:
                self.check()
            except Exception:  # the watcher must outlive any surprise
                log.exception("config watch failed")


async def run_server(config_path: str, *, port: int, admin_port: int, host: str = "0.0.0.0",
                     admin_host: str = "127.0.0.1", stop: asyncio.Event | None = None) -> None:
    path = Path(config_path)
    gateway = Gateway(config_mod.load(path))
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # so_reuseport off: a second server on a taken port must fail, not silently share it.
    # The buffered request body arrives as one message: lift gRPC's 4 MiB default above Envoy's buffer.
    # Keepalive pings find a vanished Envoy, so its streams end and their in-flight counts are released.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.keepalive_time_ms", 30_000),
                                      ("grpc.keepalive_timeout_ms", 10_000),
                                      ("grpc.http2.max_pings_without_data", 0),
                                      ("grpc.keepalive_permit_without_calls", 1)])
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(Processor(gateway), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind the ext_proc port {host}:{port}")
    serving = True
    for service in ("", EXTPROC_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)

    admin = web.AppRunner(admin_app(gateway, lambda: serving), access_log=None)
    await admin.setup()
    await web.TCPSite(admin, admin_host, admin_port).start()
    await server.start()
    watcher = asyncio.create_task(ConfigWatcher(path, gateway).run())
    log.info("ext_proc on %s:%d, admin on http://%s:%d, strategy %s", host, port, admin_host,
             admin_port, gateway.config.default_strategy)

    await stop.wait()
    serving = False
    log.info("draining: NOT_SERVING for %gs before refusing new streams",
             gateway.config.drain_notice_seconds)
    for service in ("", EXTPROC_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    watcher.cancel()
    await asyncio.sleep(gateway.config.drain_notice_seconds)
    log.info("refusing new streams; %d open, waiting up to %gs", gateway.open_streams,
             gateway.config.drain_timeout_seconds)
    # stop() refuses new streams at once, waits for open ones up to the grace, then cancels them;
    # cancellation runs each Stream.close(), so in-flight counts still balance.
    await server.stop(gateway.config.drain_timeout_seconds)
    await admin.cleanup()
    log.info("stopped; %d requests still counted in flight", gateway.inflight.total())


def serve(config_path: str, *, port: int, admin_port: int, host: str = "0.0.0.0",
          admin_host: str = "127.0.0.1") -> int:
    try:
        import uvloop  # optional: faster loop when installed
        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(run_server(config_path, port=port, admin_port=admin_port, host=host,
                               admin_host=admin_host))
    except config_mod.ConfigError as exc:
        log.error("%s", exc)
        return 2
    return 0

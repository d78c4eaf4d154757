"""The gRPC health services, with the endpoint-picker protocol's meanings beside the default one.

- `liveness`: the process answers gRPC (SERVING for as long as it runs, drain included: a draining
  gateway is alive, and restarting it would cut what it finishes);
- `readiness`: ready to route: the config is loaded and pods are known (the file's, or discovery's
  first listing); NOT_SERVING while the pool is empty and from the start of a drain;
- `envoy.service.ext_proc.v3.ExternalProcessor`: the same as readiness (the protocol says so); Envoy's
  own bootstrap checks it;
- "" (the server as a whole): SERVING until the drain starts, as before the protocol's services came.
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2

from extproc.envoy_contract import EXTPROC_SERVICE, LIVENESS_SERVICE, READINESS_SERVICE
from extproc.server.gateway import Gateway

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
READY_SERVICES = (READINESS_SERVICE, EXTPROC_SERVICE)
REFRESH_SECONDS = 1.0  # pods come and go with reloads and discovery: readiness follows within this


class HealthServices:
    def __init__(self, servicer: health.aio.HealthServicer, gateway: Gateway) -> None:
        self._servicer = servicer
        self._gw = gateway
        self._draining = False
        self._ready: bool | None = None

    async def start(self) -> None:
        await self._servicer.set(LIVENESS_SERVICE, SERVING)
        await self._servicer.set("", SERVING)
        await self.refresh()

    def ready(self) -> bool:
        return not self._draining and bool(self._gw.pool.all_pods())

    async def refresh(self) -> None:
        """Readiness as the pool stands now (called every REFRESH_SECONDS; sets only on a change)."""
        ready = self.ready()
        if ready != self._ready:
            self._ready = ready
            for service in READY_SERVICES:
                await self._servicer.set(service, SERVING if ready else NOT_SERVING)

    async def drain(self) -> None:
        """The drain starts: Envoy and Kubernetes steer new streams away; liveness stays SERVING."""
        self._draining = True
        await self._servicer.set("", NOT_SERVING)
        await self.refresh()

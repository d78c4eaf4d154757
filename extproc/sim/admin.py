"""The simulator's admin endpoints (/sim/info, /sim/timeline, /sim/faults) and the outages they start.

An outage (`refuse_connections`: "refuse" or "reset") stops the replica's listener, drops its open
connections as a crashed engine would, and ends by itself after `outage_seconds`: nothing could
switch it off, since the admin endpoint is on the same port.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from extproc.sim.faults import FaultConfig
from extproc.sim.streams import json_error

if TYPE_CHECKING:
    from extproc.sim.live import LiveReplica

log = logging.getLogger(__name__)


class Admin:
    def __init__(self, replica: LiveReplica, listen: Callable[[str | None], Awaitable[None]],
                 drop_connections: Callable[[Any], None]) -> None:
        self.replica = replica
        self._listen = listen  # the server's: serve (None), "refuse" or "reset"
        self._drop_connections = drop_connections  # every open connection but the one given
        self.outage: asyncio.Task[None] | None = None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/sim/info", self._info)
        app.router.add_get("/sim/timeline", self._timeline)
        app.router.add_get("/sim/faults", self._get_faults)
        app.router.add_post("/sim/faults", self._set_faults)

    def apply_faults(self, faults: FaultConfig, outage_seconds: float = 5.0, keep: Any = None) -> None:
        """Change faults at runtime. A refuse/reset outage also drops open connections (as a crashed
        engine would) except `keep`, and ends after `outage_seconds`: nothing could switch it off."""
        r = self.replica
        r.faults = faults
        r.fault_t0 = asyncio.get_running_loop().time()  # slow start counts from this change
        r.engine.set_kv_pressure(faults.kv_pressure)
        if self.outage is not None:
            self.outage.cancel()
        if faults.refuse_connections:
            self.outage = asyncio.create_task(
                self._run_outage(faults.refuse_connections, outage_seconds, keep))

    async def _run_outage(self, mode: str, seconds: float, keep: Any) -> None:
        r = self.replica
        await self._listen(mode)
        self._drop_connections(keep)
        await asyncio.sleep(seconds)
        r.faults = dataclasses.replace(r.faults, refuse_connections=None)
        await self._listen(None)
        log.info("engine-sim %s: outage over, serving again", r.spec.name)

    async def _info(self, request: web.Request) -> web.Response:
        r = self.replica
        perf = r.engine.perf
        return web.json_response(
            {
                "name": r.spec.name,
                "model": r.spec.model_name,
                "engine": r.spec.engine,
                "gpu": {
                    "name": perf.gpu.name,
                    "memory_gb": perf.gpu.memory_gb,
                    "bandwidth_gbps": perf.gpu.bandwidth_gbps,
                    "tflops": perf.gpu.tflops,
                    "price_per_hour": perf.gpu.price_per_hour,
                },
                "tensor_parallel": perf.tensor_parallel,
                "time_scale": r.spec.time_scale,
                "kv_blocks": r.engine.kv.total_blocks,
                "block_size": r.engine.config.block_size,
                "max_model_len": r.engine.max_model_len,
                "max_num_seqs": r.engine.config.max_num_seqs,
                "decode_step_s_batch1": perf.decode_step_time(1, 512),
                "lag_seconds": r.pacer.lag_seconds,
                "delivery_lateness_ms": r.pacer.lateness.summary(),
                "sim_now": r.pacer.now(),
                "steps": r.engine.steps_total,
            }
        )

    async def _get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(dataclasses.asdict(self.replica.faults))

    async def _set_faults(self, request: web.Request) -> web.Response:
        """Replace the fault config at runtime: a JSON object of FaultConfig fields (absent = off), plus
        `outage_seconds` (default 5) for refuse_connections. Slow start counts from this call."""
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            outage = float(body.pop("outage_seconds", 5.0))
            faults = FaultConfig.from_dict(body)
        except (ValueError, KeyError, TypeError) as e:
            return json_error(400, str(e))
        self.apply_faults(faults, outage, keep=request.transport)
        resp = web.json_response(dataclasses.asdict(faults))
        resp.force_close()  # this connection is not dropped by an outage; close it cleanly instead
        return resp

    async def _timeline(self, request: web.Request) -> web.Response:
        """Per-request model timestamps of each token (sum of step durations), for the benchmark."""
        r = self.replica
        if not r.spec.record_timeline:
            return json_error(404, "start the simulator with --record-timeline", "NotFoundError")
        return web.json_response(
            {"time_scale": r.spec.time_scale, "lag_seconds": r.pacer.lag_seconds, "timelines": r.timelines}
        )

"""The imperative shell: an aiohttp server that speaks OpenAI and drives one `Engine` on a scaled clock.

One engine-loop task per replica steps the model, sleeps until the step's end on the wall clock, then
hands the emitted tokens to the waiting responders (one future per stream, woken once per step), so the
cost is one timer per step, not one per token per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
import uuid
from typing import Any

from aiohttp import HttpVersion11, web

from extproc.sim.engine import CapacityError, Engine, SimRequest, StepResult
from extproc.sim.faults import FaultConfig, RequestFaults, decide, in_slow_start
from extproc.sim.metrics import EngineMetrics
from extproc.sim.protocol import (
    DONE,
    ChunkFormatter,
    RequestError,
    full_response,
    parse_request,
    sample_output_len,
)
from extproc.sim.replica import ReplicaSpec
from extproc.sim.streams import (
    CONNECTION_BROKEN,
    ENGINE_DIED,
    KV_DROPPED,
    SHUTTING_DOWN,
    DirectSink,
    Failure,
    Lateness,
    TokenStream,
    json_error,
)

log = logging.getLogger(__name__)

# Timer lateness (wall seconds) that the loop absorbs by starting the next step at the previous step's
# model end time, so jitter does not accumulate into drift. Larger lateness is time really lost.
LATE_TOLERANCE_S = 0.02
MAX_STEPS_WITHOUT_YIELD = 16
MAX_WAKE_BIAS_S = 0.003
SPIN_MIN_STEP_S = 0.004  # below this a step is too short for sub-ms precision to matter: don't spin
MAX_TIMELINES = 100_000
# How long runner.cleanup() lets handlers finish on shutdown. Open streams are dropped first, so what is
# left is short work; aiohttp's default (60 s) would only hold up a SIGTERM.
SHUTDOWN_TIMEOUT_S = 1.0


class ReplicaServer:
    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.engine: Engine = spec.build_engine()
        self.rng = random.Random(spec.seed)
        self.metrics = EngineMetrics(spec.engine, spec.model_name, self.engine, self.sim_now)
        self.port = spec.port
        self.lag_seconds = 0.0  # model time lost to an overloaded event loop (should stay ~0)
        self.dead = False  # the engine loop died: nothing will be generated any more
        self.lateness = Lateness()  # wall time between a step's planned end and its tokens' delivery
        self._wake_bias = 0.001  # how early to set the timer (learned)
        self.timelines: dict[str, list[float]] = {}
        self._streams: dict[str, TokenStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._wall_t0 = 0.0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._reset_server: asyncio.AbstractServer | None = None
        # Faults can be changed at runtime (POST /sim/faults); slow start counts from the last change.
        self.faults = spec.faults
        self._fault_t0 = 0.0
        self._outage: asyncio.Task[None] | None = None

    # --- clock ---------------------------------------------------------------------------------------
    def sim_now(self) -> float:
        if self._loop is None:
            return 0.0
        return (self._loop.time() - self._t0) * self.spec.time_scale

    def _since_start(self) -> float:
        return self._loop.time() - self._t0 if self._loop else 0.0

    def _slow(self) -> bool:
        return self._loop is not None and in_slow_start(self.faults, self._loop.time() - self._fault_t0)

    # --- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._wall_t0 = time.time()
        self._wake = asyncio.Event()
        self._fault_t0 = self._t0
        mode = self.faults.refuse_connections
        self._runner = web.AppRunner(
            self._app(), handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
        )
        await self._runner.setup()
        await self._listen(mode)
        # mode == "refuse": nothing listens, so connections are refused by the kernel.
        self._task = asyncio.create_task(self._engine_loop(), name=f"engine-{self.spec.name}")
        self._task.add_done_callback(self._loop_ended)
        log.info(
            "engine-sim %s: %s on %s, %s (%s), port %d, %d KV blocks, time scale %g%s",
            self.spec.name,
            self.spec.model_name,
            self.engine.perf.gpu.name,
            self.spec.engine,
            f"TP={self.engine.perf.tensor_parallel}",
            self.port,
            self.engine.total_blocks,
            self.spec.time_scale,
            f", refusing connections ({mode})" if mode else "",
        )

    async def stop(self) -> None:
        # Open streams first: once the engine loop is gone nothing would ever finish them, and their
        # handlers would hold runner.cleanup() for its whole timeout. Dropped as a dying engine would.
        self._fail_streams(SHUTTING_DOWN, drop=True)
        for task in (self._outage, self._task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                except Exception:  # a dead engine loop: _loop_ended logged it
                    pass
        await self._listen("refuse")
        if self._runner is not None:
            await self._runner.cleanup()

    async def _listen(self, mode: str | None) -> None:
        """Serve HTTP (None), accept-and-drop connections ("reset"), or have nothing listen ("refuse")."""
        if self._site is not None:
            await self._site.stop()
            self._site = None
        if self._reset_server is not None:
            self._reset_server.close()
            await self._reset_server.wait_closed()
            self._reset_server = None
        host = self.spec.host
        if mode == "reset":
            self._reset_server = await asyncio.start_server(
                self._reset_connection, host, self.port, reuse_address=True
            )
            self.port = self._reset_server.sockets[0].getsockname()[1]
        elif mode is None:
            assert self._runner is not None
            self._site = web.TCPSite(self._runner, host, self.port, backlog=2048, reuse_address=True)
            await self._site.start()
            server = self._site._server  # the bound port, for port 0
            if server is not None and server.sockets:  # type: ignore[union-attr]
                self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def apply_faults(self, faults: FaultConfig, outage_seconds: float = 5.0, keep: Any = None) -> None:
        """Change faults at runtime. A refuse/reset outage also drops open connections (as a crashed
        engine would) except `keep`, and ends after `outage_seconds`: nothing could switch it off."""
        assert self._loop is not None
        self.faults = faults
        self._fault_t0 = self._loop.time()
        self.engine.set_kv_pressure(faults.kv_pressure)
        if self._outage is not None:
            self._outage.cancel()
        if faults.refuse_connections:
            self._outage = asyncio.create_task(
                self._run_outage(faults.refuse_connections, outage_seconds, keep)
            )

    async def _run_outage(self, mode: str, seconds: float, keep: Any) -> None:
        await self._listen(mode)
        if self._runner is not None and self._runner.server is not None:
            for handler in list(self._runner.server.connections):
                transport = handler.transport
                if transport is not None and transport is not keep:
                    transport.abort()
        await asyncio.sleep(seconds)
        self.faults = dataclasses.replace(self.faults, refuse_connections=None)
        await self._listen(None)
        log.info("engine-sim %s: outage over, serving again", self.spec.name)

    def _broken(self, rid: str, s: TokenStream) -> None:
        """A stream's socket write failed: drop that connection and its request, keep the loop going."""
        log.warning("engine-sim %s: dropping %s after a write error", self.spec.name, rid, exc_info=True)
        s.sink = None
        if s.transport is not None:
            s.transport.abort()
        s.fail(CONNECTION_BROKEN)
        self.engine.abort(rid)

    def _fail_streams(self, failure: Failure, drop: bool) -> None:
        """End every open stream with `failure`; `drop` also closes its connection at once."""
        for s in list(self._streams.values()):
            s.fail(failure)
            if drop and s.transport is not None:
                s.transport.abort()

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        # A dead engine loop would hang every stream: make it loud, end them with an error, and say so on
        # /health and to new requests, so a gateway takes this replica out instead of waiting on it.
        if not task.cancelled() and task.exception() is not None:
            log.error("engine-sim %s: engine loop died", self.spec.name, exc_info=task.exception())
            self.dead = True
            self._fail_streams(ENGINE_DIED, drop=False)  # handlers still run: they write the error

    async def _reset_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()  # fault: accept, then drop the connection at once

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_openai_http_errors])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/sim/info", self._info)
        app.router.add_get("/sim/timeline", self._timeline)
        app.router.add_get("/sim/faults", self._get_faults)
        app.router.add_post("/sim/faults", self._set_faults)
        return app

    # --- the engine loop -----------------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        assert self._loop is not None and self._wake is not None
        loop, engine, scale = self._loop, self.engine, self.spec.time_scale
        tolerance = LATE_TOLERANCE_S * scale
        prev_end: float | None = None
        behind = 0
        while True:
            if not engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                prev_end = None
                continue
            now = self.sim_now()
            start = now
            if prev_end is not None:
                if now - prev_end <= tolerance:
                    start = prev_end
                else:
                    self.lag_seconds += (now - prev_end) / scale
            engine.slowdown = self.faults.slow_start_factor if self._slow() else 1.0
            res = engine.step(start)
            if res is None:  # nothing schedulable; wait for an arrival or an abort to change that
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 0.05)
                except TimeoutError:
                    pass
                prev_end = None
                continue
            target = self._t0 + res.end / scale
            delay = target - loop.time() - self._wake_bias
            if delay > 0:
                await asyncio.sleep(delay)
                # asyncio timers fire late (epoll rounds up to whole ms, plus wake-up latency): learn by
                # how much, aim that much early, and finish the wait by yielding rather than by a timer.
                late = loop.time() - (target - self._wake_bias)
                self._wake_bias = min(
                    MAX_WAKE_BIAS_S, max(0.0, self._wake_bias + 0.1 * (late - self._wake_bias))
                )
                if res.duration / scale >= SPIN_MIN_STEP_S:
                    while loop.time() < target:
                        await asyncio.sleep(0)
                behind = 0
            elif target > loop.time() and res.duration / scale >= SPIN_MIN_STEP_S:
                while loop.time() < target:
                    await asyncio.sleep(0)
                behind = 0
            else:
                # The step already ended on the wall clock (high time scale: steps shorter than a timer
                # tick). Deliver at once and run the next step from its model start: no time is lost. Yield
                # now and then so arrivals and responders get the loop.
                behind += 1
                if behind >= MAX_STEPS_WITHOUT_YIELD:
                    behind = 0
                    await asyncio.sleep(0)
            self.lateness.add(loop.time() - (self._t0 + res.end / scale))
            self._deliver(res)
            prev_end = res.end

    def _deliver(self, res: StepResult) -> None:
        streams = self._streams
        stamp = self.engine.busy_seconds_total  # model time: the sum of step durations so far
        for rid in res.emitted:
            s = streams.get(rid)
            if s is not None:
                s.tokens += 1
                if s.stamps is not None:
                    s.stamps.append(stamp)
                if s.sink is not None:
                    try:
                        s.sink.emit(s.tokens)  # written now; the handler only wakes at the end
                    except Exception:  # one bad socket must not kill the loop
                        self._broken(rid, s)
                else:
                    s.notify()
        self.metrics.observe_step(res)
        for seq in res.first_tokens:
            self.metrics.observe_first_token(seq)
        for seq in res.finished:
            self.metrics.observe_finished(seq)
            s = streams.get(seq.request_id)
            if s is not None and not s.done:
                s.done, s.seq = True, seq
                if s.sink is not None:
                    try:
                        s.sink.finish()
                    except Exception:  # as above
                        self._broken(seq.request_id, s)
                s.notify()
        for seq in res.failed:
            s = streams.get(seq.request_id)
            if s is not None:
                s.fail(KV_DROPPED)

    # --- handlers ------------------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return json_error(400, "request body is not valid JSON")
        try:
            parsed = parse_request(body, chat, self.engine.config.block_size)
        except RequestError as e:
            return json_error(e.status, e.message, e.type, e.param, e.code)
        if parsed.model not in (self.spec.model_name, self.spec.model):
            return json_error(404, f"The model `{parsed.model}` does not exist.", "NotFoundError", "model", 404)
        limit = self.engine.max_model_len - parsed.prompt_tokens
        max_tokens = parsed.max_tokens
        if max_tokens is None:
            max_tokens = sample_output_len(self.rng, self.spec.output_len_median, max(1, limit))
        fault = decide(self.faults, self.rng, max_tokens)
        if fault.error_status is not None:
            kind = "ServiceUnavailableError" if fault.error_status == 503 else "InternalServerError"
            return json_error(
                fault.error_status,
                "simulated engine failure (fault injection)",
                kind,
                None,
                fault.error_status,
            )
        if self.dead:
            return ENGINE_DIED.response()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            request_ = SimRequest(rid, parsed.prompt_tokens, max_tokens, parsed.block_hashes)
            self.engine.add(request_, self.sim_now())
        except CapacityError as e:
            return json_error(400, str(e), param="max_tokens")
        stream = TokenStream(self.spec.record_timeline, request.transport)
        self._streams[rid] = stream
        assert self._wake is not None
        self._wake.set()
        finish_reason = "length" if parsed.max_tokens is not None else "stop"
        created = int(self._wall_t0 + self._since_start())
        try:
            if parsed.stream:
                return await self._stream(
                    request,
                    stream,
                    fault,
                    rid,
                    parsed.chat,
                    created,
                    parsed.prompt_tokens,
                    max_tokens,
                    finish_reason,
                    parsed.include_usage,
                )
            while not stream.done:
                if fault.abort_after is not None and stream.tokens >= fault.abort_after:
                    return _drop(request)
                await stream.wait()
            if stream.failure is not None:
                return stream.failure.response()
            if fault.stall_after is not None:
                await asyncio.sleep(self.faults.stall_seconds)
            return web.json_response(
                full_response(
                    chat, rid, self.spec.model_name, created, parsed.prompt_tokens, max_tokens, finish_reason
                )
            )
        finally:
            self._streams.pop(rid, None)
            if not stream.done:
                self.engine.abort(rid)
            finished = stream.done and stream.failure is None
            if stream.stamps is not None and finished and len(self.timelines) < MAX_TIMELINES:
                self.timelines[rid] = stream.stamps

    async def _stream(
        self,
        request: web.Request,
        stream: TokenStream,
        fault: RequestFaults,
        rid: str,
        chat: bool,
        created: int,
        prompt_tokens: int,
        max_tokens: int,
        finish_reason: str,
        include_usage: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        fmt = ChunkFormatter(chat, rid, self.spec.model_name, created)
        last = max_tokens - 1
        direct = (
            fault.abort_after is None
            and fault.stall_after is None
            and request.version >= HttpVersion11
            and request.transport is not None
        )
        if direct:
            resp.enable_chunked_encoding()
            await resp.prepare(request)  # StreamResponse sends its headers here, before our first chunk
            assert request.transport is not None
            sink = DirectSink(request.transport, fmt, last, finish_reason, include_usage, prompt_tokens)
            stream.sink = sink
            if stream.tokens:  # tokens that arrived while the headers were being sent
                sink.emit(stream.tokens)
            if stream.done:
                sink.finish(stream.failure)
            while not stream.done:
                await stream.wait()
            if _dropped(request):
                return resp  # shutdown or an unread buffer dropped it: aiohttp ends the response quietly
            await resp.write_eof()
            return resp
        # Slow path (faults that shape the stream, HTTP/1.0): the handler writes, woken once per step.
        await resp.prepare(request)
        try:
            await self._write_slowly(request, resp, stream, fault, fmt, last, finish_reason, prompt_tokens,
                                     include_usage)
        except ConnectionError:
            pass  # the connection was dropped (client gone, fault, shutdown): nothing left to write to
        return resp

    async def _write_slowly(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        stream: TokenStream,
        fault: RequestFaults,
        fmt: ChunkFormatter,
        last: int,
        finish_reason: str,
        prompt_tokens: int,
        include_usage: bool,
    ) -> None:
        written = 0
        stalled = False
        while True:
            if stream.tokens == written and not stream.done:
                await stream.wait()
            target = stream.tokens
            if fault.abort_after is not None:
                target = min(target, fault.abort_after)
            if fault.stall_after is not None and not stalled:
                target = min(target, fault.stall_after)
            if target > written:
                data = fmt.tokens(written, target, last, finish_reason)
                written = target
                await resp.write(data)
            if fault.abort_after is not None and written >= fault.abort_after:
                _drop(request)
                return
            if fault.stall_after is not None and not stalled and written >= fault.stall_after:
                stalled = True
                await asyncio.sleep(self.faults.stall_seconds)
                continue
            if stream.done and written >= stream.tokens:
                break
        if stream.failure is not None:
            tail = stream.failure.event()
        else:
            tail = fmt.usage(prompt_tokens, written) if include_usage else b""
        await resp.write(tail + DONE)
        await resp.write_eof()

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.spec.model_name,
            "object": "model",
            "created": int(self._wall_t0),
            "owned_by": self.spec.engine,
            "root": self.spec.model,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
            "permission": [],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _health(self, request: web.Request) -> web.Response:
        if self.dead:
            return web.Response(status=500, text="engine loop died")
        if self._slow():
            return web.Response(status=503, text="starting")
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    async def _info(self, request: web.Request) -> web.Response:
        perf = self.engine.perf
        return web.json_response(
            {
                "name": self.spec.name,
                "model": self.spec.model_name,
                "engine": self.spec.engine,
                "gpu": {
                    "name": perf.gpu.name,
                    "memory_gb": perf.gpu.memory_gb,
                    "bandwidth_gbps": perf.gpu.bandwidth_gbps,
                    "tflops": perf.gpu.tflops,
                    "price_per_hour": perf.gpu.price_per_hour,
                },
                "tensor_parallel": perf.tensor_parallel,
                "time_scale": self.spec.time_scale,
                "kv_blocks": self.engine.total_blocks,
                "block_size": self.engine.config.block_size,
                "max_model_len": self.engine.max_model_len,
                "max_num_seqs": self.engine.config.max_num_seqs,
                "decode_step_s_batch1": perf.decode_step_time(1, 512),
                "lag_seconds": self.lag_seconds,
                "delivery_lateness_ms": self.lateness.summary(),
                "sim_now": self.sim_now(),
                "steps": self.engine.steps_total,
            }
        )

    async def _get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(dataclasses.asdict(self.faults))

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
        if not self.spec.record_timeline:
            return json_error(404, "start the simulator with --record-timeline", "NotFoundError")
        return web.json_response(
            {"time_scale": self.spec.time_scale, "lag_seconds": self.lag_seconds, "timelines": self.timelines}
        )


@web.middleware
async def _openai_http_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own 404/405/413 answers, in the OpenAI error shape clients parse."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return json_error(exc.status, f"{request.method} {request.path}: {exc.reason}",
                      "NotFoundError" if exc.status == 404 else "invalid_request_error")


def _drop(request: web.Request) -> web.StreamResponse:
    """Fault: close the connection mid-response, without the terminating chunk or [DONE]."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=500)


def _dropped(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()

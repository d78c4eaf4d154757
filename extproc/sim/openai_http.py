"""The simulator's engine-facing HTTP: OpenAI completions (JSON and SSE), /v1/models, /health, /metrics.

A request is parsed, given its faults, added to the engine, and answered as the pacer delivers its
tokens: streamed straight from the engine loop to the socket (`streams.DirectSink`), or, when faults
shape the stream or the client speaks HTTP/1.0, written by the handler, woken once per step.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import HttpVersion11, web

from extproc.sim.faults import RequestFaults, decide
from extproc.sim.protocol import (
    DONE,
    ChunkFormatter,
    RequestError,
    full_response,
    parse_request,
    sample_output_len,
)
from extproc.sim.sequences import CapacityError, SimRequest
from extproc.sim.streams import ENGINE_DIED, DirectSink, TokenStream, json_error

if TYPE_CHECKING:
    from extproc.sim.live import LiveReplica

MAX_TIMELINES = 100_000


class OpenAIHandlers:
    def __init__(self, replica: LiveReplica) -> None:
        self.replica = replica

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        r = self.replica
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return json_error(400, "request body is not valid JSON")
        try:
            parsed = parse_request(body, chat, r.engine.config.block_size)
        except RequestError as e:
            return json_error(e.status, e.message, e.type, e.param, e.code)
        if parsed.model not in (r.spec.model_name, r.spec.model):
            return json_error(404, f"The model `{parsed.model}` does not exist.", "NotFoundError", "model",
                              404)
        limit = r.engine.max_model_len - parsed.prompt_tokens
        max_tokens = parsed.max_tokens
        if max_tokens is None:
            max_tokens = sample_output_len(r.rng, r.spec.output_len_median, max(1, limit))
        fault = decide(r.faults, r.rng, max_tokens)
        if fault.error_status is not None:
            kind = "ServiceUnavailableError" if fault.error_status == 503 else "InternalServerError"
            return json_error(
                fault.error_status,
                "simulated engine failure (fault injection)",
                kind,
                None,
                fault.error_status,
            )
        if r.dead:
            return ENGINE_DIED.response()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            request_ = SimRequest(rid, parsed.prompt_tokens, max_tokens, parsed.block_hashes)
            r.engine.add(request_, r.pacer.now())
        except CapacityError as e:
            return json_error(400, str(e), param="max_tokens")
        stream = TokenStream(r.spec.record_timeline, request.transport)
        r.streams[rid] = stream
        r.pacer.wake()
        finish_reason = "length" if parsed.max_tokens is not None else "stop"
        created = int(r.wall_t0 + r.pacer.since_start())
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
                await asyncio.sleep(r.faults.stall_seconds)
            return web.json_response(
                full_response(
                    chat, rid, r.spec.model_name, created, parsed.prompt_tokens, max_tokens, finish_reason
                )
            )
        finally:
            r.streams.pop(rid, None)
            if not stream.done:
                r.engine.abort(rid)
            finished = stream.done and stream.failure is None
            if stream.stamps is not None and finished and len(r.timelines) < MAX_TIMELINES:
                r.timelines[rid] = stream.stamps

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
        r = self.replica
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        fmt = ChunkFormatter(chat, rid, r.spec.model_name, created)
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
        r = self.replica
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
                await asyncio.sleep(r.faults.stall_seconds)
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
        r = self.replica
        card = {
            "id": r.spec.model_name,
            "object": "model",
            "created": int(r.wall_t0),
            "owned_by": r.spec.engine,
            "root": r.spec.model,
            "parent": None,
            "max_model_len": r.engine.max_model_len,
            "permission": [],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _health(self, request: web.Request) -> web.Response:
        r = self.replica
        if r.dead:
            return web.Response(status=500, text="engine loop died")
        if r.slow():
            return web.Response(status=503, text="starting")
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        r = self.replica
        return web.Response(
            body=r.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )


@web.middleware
async def openai_http_errors(request: web.Request, handler: Any) -> web.StreamResponse:
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

"""The simulator's HTTP parser limits, and its answer when a request breaks them: OpenAI-style JSON.

aiohttp refuses a header line over 8 KiB with a `text/plain` 400 that echoes part of the header,
where every other error of the simulator (and of vLLM) is JSON. Its lines are allowed up to 16 KiB
here, above Envoy's whole header block (`ENVOY_MAX_REQUEST_HEADERS_KB`), so what Envoy lets through
the simulator takes; what it still refuses (a client calling it directly) gets a JSON 400 that
repeats nothing of the request.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from extproc.sim.protocol import error_body

MAX_LINE_BYTES = 16 * 1024  # a request line or one header line


class _JsonErrorHandler(RequestHandler):
    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        response = super().handle_error(request, status, exc, message)  # logs, checks nothing was sent
        if status >= 500:
            return response
        text = "request line or headers too large, or malformed" if status == 400 else "bad request"
        body = json.dumps(error_body(text, "BadRequestError", None, status))
        response = web.Response(status=status, text=body, content_type="application/json")
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorRunner(web.AppRunner):
    """An AppRunner whose connections take MAX_LINE_BYTES lines and answer a bad request in JSON."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, max_line_size=MAX_LINE_BYTES, max_field_size=MAX_LINE_BYTES, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # aiohttp offers no hook for the handler's class
        return server

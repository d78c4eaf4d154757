"""The ext_proc stream state machine: one Stream per HTTP request, driven message by message.

headers -> (buffered) body -> route -> response headers -> streamed response body -> end.
Stream.handle is synchronous and does no I/O, so it is unit-testable over a fake message sequence.
"""

from __future__ import annotations

import logging
import uuid

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from extproc import openai
from extproc.openai import OpenAIError
from extproc.pool import Pod
from extproc.routing import UnknownStrategy, strategy_names
from extproc.server import responses
from extproc.server.gateway import Gateway
from extproc.state.inflight import Ticket

log = logging.getLogger(__name__)

STRATEGY_HEADER = "routing-strategy"
MODEL_HEADER = "model"
REQUEST_ID_HEADER = "x-request-id"
TARGET_POD_HEADER = "target-pod"


def _headers(http_headers) -> dict[str, str]:
    # Envoy sends values in raw_value (bytes); older Envoys used value.
    return {h.key: (h.raw_value.decode("latin-1") if h.raw_value else h.value)
            for h in http_headers.headers.headers}


class Stream:
    __slots__ = ("_gw", "_path", "_strategy", "_request_id", "_header_model", "_model", "_pod",
                 "_ticket", "_status", "_done")

    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway
        self._path = ""
        self._strategy = ""
        self._request_id = ""
        self._header_model: str | None = None
        self._model = ""
        self._pod: Pod | None = None
        self._ticket: Ticket | None = None
        self._status = ""
        self._done = False

    @property
    def pod(self) -> Pod | None:
        return self._pod

    @property
    def done(self) -> bool:
        return self._done

    def handle(self, msg: ProcessingRequest) -> ProcessingResponse:
        kind = msg.WhichOneof("request")
        try:
            if kind == "response_body":
                if msg.response_body.end_of_stream:
                    self._finish(self._status)
                return responses.CONTINUE_RESPONSE_BODY
            if kind == "request_headers":
                return self._on_request_headers(msg.request_headers)
            if kind == "request_body":
                return self._on_request_body(msg.request_body)
            if kind == "response_headers":
                return self._on_response_headers(msg.response_headers)
            if kind == "request_trailers":
                return responses.CONTINUE_REQUEST_TRAILERS
            if kind == "response_trailers":
                self._finish(self._status)
                return responses.CONTINUE_RESPONSE_TRAILERS
            raise OpenAIError(500, f"unexpected ext_proc message {kind!r}", type="server_error")
        except OpenAIError as err:
            return self._reject(err)
        except Exception:  # a bug must cost one request, never the stream's bookkeeping
            log.exception("request %s: gateway error", self._request_id)
            return self._reject(OpenAIError(500, "internal gateway error", type="server_error"))

    def close(self) -> None:
        """Called when the gRPC stream ends for any reason: the one place nothing can skip."""
        self._finish("aborted")

    # -- request path ----------------------------------------------------------------------------

    def _on_request_headers(self, http_headers) -> ProcessingResponse:
        headers = _headers(http_headers)
        path = self._path = headers.get(":path", "").split("?", 1)[0]
        method = headers.get(":method", "")
        self._request_id = headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        self._header_model = headers.get(MODEL_HEADER)
        gw = self._gw

        if path == openai.MODELS_PATH:
            if method != "GET":
                raise OpenAIError(405, f"{method} {path}: only GET is allowed", code="method_not_allowed")
            self._finish("200")
            return responses.immediate(200, openai.models_body(gw.pool.models()), self._reply_headers())
        if path not in gw.config.model_paths:
            # Only inference endpoints reach the engines; their admin endpoints stay out of reach.
            raise OpenAIError(404, f"{path} is not served by this gateway", code="unknown_route")
        if method != "POST":
            raise OpenAIError(405, f"{method} {path}: only POST is allowed", code="method_not_allowed")
        if http_headers.end_of_stream:
            raise openai.bad_request("request body is required", code="missing_body")
        strategy = (headers.get(STRATEGY_HEADER) or gw.config.default_strategy).strip().lower()
        try:
            gw.profile(strategy)
        except UnknownStrategy:
            raise openai.bad_request(
                f"unknown routing strategy {strategy!r}; valid: {', '.join(strategy_names())}",
                param=STRATEGY_HEADER, code="unknown_routing_strategy") from None
        # Only now: metric labels and reply headers must carry known names, never raw client input.
        self._strategy = strategy
        # A client must never choose the upstream: strip any destination header it sent.
        return responses.request_headers(gw.client_forbidden_headers)

    def _on_request_body(self, http_body) -> ProcessingResponse:
        # BUFFERED mode sends the whole body in one message; end_of_stream is false only when request
        # trailers follow (HTTP/2), so this message is routed whatever that flag says.
        limit = self._gw.config.max_body_bytes
        if len(http_body.body) > limit:
            raise OpenAIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        request = openai.parse_request(self._path, http_body.body, self._header_model)
        gw = self._gw
        if not gw.pool.has_model(request.model):
            raise OpenAIError(404, f"the model {request.model!r} does not exist", param="model",
                              code="model_not_found")
        self._model = request.model
        pod = gw.choose(request, gw.profile(self._strategy))
        if pod is None:
            raise OpenAIError(503, f"no ready pod for model {request.model!r}",
                              type="service_unavailable", code="no_ready_pod")
        self._pod = pod
        self._ticket = gw.inflight.acquire(pod)
        return responses.route(gw.config.destination_header, pod.address)

    # -- response path ---------------------------------------------------------------------------

    def _on_response_headers(self, http_headers) -> ProcessingResponse:
        for h in http_headers.headers.headers:
            if h.key == ":status":
                self._status = h.raw_value.decode() if h.raw_value else h.value
                break
        reply = responses.response_headers(self._reply_headers())
        if http_headers.end_of_stream:
            self._finish(self._status)
        return reply

    def _reply_headers(self) -> list[tuple[str, str]]:
        headers = [("request-id", self._request_id)]
        if self._strategy:
            headers.append((STRATEGY_HEADER, self._strategy))
        if self._pod is not None:
            headers.append((TARGET_POD_HEADER, self._pod.name))
        return headers

    # -- endings ---------------------------------------------------------------------------------

    def _reject(self, err: OpenAIError) -> ProcessingResponse:
        self._finish(str(err.status))
        return responses.immediate(err.status, err.body(), self._reply_headers())

    def _finish(self, outcome: str) -> None:
        """Release the in-flight count and count the request: exactly once, whatever ends it."""
        if self._done:
            return
        self._done = True
        if self._ticket is not None:
            self._ticket.release()
        self._gw.requests_total.labels(self._model, self._pod.name if self._pod else "",
                                       self._strategy, outcome).inc()


class Processor(external_processor_pb2_grpc.ExternalProcessorServicer):
    """The gRPC face of the gateway: one ext_proc stream per HTTP request."""

    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway

    async def Process(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        stream = Stream(self._gw)
        self._gw.open_streams += 1
        try:
            async for msg in request_iterator:
                yield stream.handle(msg)
        finally:
            stream.close()
            self._gw.open_streams -= 1

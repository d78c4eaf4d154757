"""The ext_proc stream state machine: one Stream per HTTP request.

Our own bootstrap (envoy_bootstrap.py): a request with a body (content-length > 0) is one message: its
buffered body, with the headers routing reads as attributes (server/attributes.py) -> route (envoy.lb
metadata, optional body rewrite). Others (no content-length: chunked or HTTP/2 bodies, bodiless requests
such as GET /v1/models) come as two, on a route that keeps Envoy's request headers message: request
headers -> buffered body -> route (destination header + metadata). Envoy closes the stream once routed;
the response streams from the pod to the client without the gateway, and its outcome comes back once per
request through the access log (server/access_log.py).

An InferencePool's data plane (Envoy Gateway, Envoy AI Gateway, `envoy-config --pool`) speaks the
endpoint-picker protocol (docs/conformance.md): the request headers without our attributes, the body in
whichever mode it configured (body.py reassembles it and shapes the answer), the subset hint in the
request's metadata, an ordered fallback list in the answer; the stream then stays open for the response
headers, whose metadata names the endpoint that served the request (accounted there), and its end is
the request's end.
Stream.handle is synchronous and does no I/O, so it is unit-testable over a fake message sequence.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from google.protobuf.message import DecodeError
from prometheus_client import Counter

from extproc import admission, openai
from extproc.envoy_contract import (
    AUTHORIZATION_HEADER,
    ENVOY_MAX_HEADERS,
    ENVOY_REQUEST_ID_HEADER,
    EXTPROC_SERVICE,
    LB_METADATA_NAMESPACE,
    MODEL_HEADER,
    ROUTED_REQUEST_ID_HEADER,
    SERVED_KEY,
    SESSION_HEADER,
    STRATEGY_HEADER,
    TRACEPARENT_HEADER,
)
from extproc.openai import OpenAIError, Request
from extproc.ratelimit import Admission
from extproc.routing import Profile, StrategySpec, StrategySpecError, strategy_names
from extproc.routing.framework import LiveRoom, UnknownStrategy, Waiting, waiting_for, waitings
from extproc.routing.outcome import Queued, Rejected, Routed
from extproc.routing.session_affinity import MAX_SESSION_KEY_BYTES
from extproc.server import attributes, body, responses
from extproc.server.gateway import Gateway
from extproc.server.heap import HeapTrimmer
from extproc.vocabulary import RequestEnd

log = logging.getLogger(__name__)

# Bodies above this are parsed off the event loop, so one long prompt never stalls other streams.
OFFLOAD_BODY_BYTES = 256 * 1024


WANTED_HEADERS = frozenset({":path", ":method", ENVOY_REQUEST_ID_HEADER, MODEL_HEADER, STRATEGY_HEADER,
                            "content-length", AUTHORIZATION_HEADER, SESSION_HEADER, TRACEPARENT_HEADER})


def _headers(http_headers) -> dict[str, str]:
    """Only the headers routing reads (a request may carry dozens)."""
    # Envoy sends values in raw_value (bytes); older Envoys used value.
    return {h.key: (_text(h.raw_value) if h.raw_value else h.value)
            for h in http_headers.headers.headers if h.key in WANTED_HEADERS}


def _text(raw: bytes) -> str:
    """A header value as text: UTF-8, as Envoy's attributes carry it, so a key or model with non-ASCII
    characters is the same string (the same budget, the same digest) whichever path the request took;
    bytes that are not UTF-8, which the attributes cannot carry at all, as latin-1 (one per byte)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _header_bytes(value: str) -> int:
    """A header value's length on the wire (a value that was not UTF-8 counts its bytes above 0x7f
    twice: only ever against a bound, on input no other path accepts)."""
    return len(value.encode())


# Stands for a message protobuf refused to parse: Envoy sends the headers routing reads as attribute
# strings (server/attributes.py), and a header value that is not UTF-8 makes the whole message invalid.
UNDECODABLE = ProcessingRequest()


def decode(data: bytes) -> ProcessingRequest:
    """The gRPC request deserializer: a refused message becomes UNDECODABLE, answered with a 400, where
    an exception would fail the stream and Envoy would answer a retryable 503 (and log a traceback)."""
    try:
        return ProcessingRequest.FromString(data)
    except DecodeError:
        return UNDECODABLE


def add_to_server(processor: Processor, server: grpc.aio.Server) -> None:
    """Serve `processor` as Envoy's ExternalProcessor, with the lenient deserializer."""
    handler = grpc.stream_stream_rpc_method_handler(
        processor.Process, request_deserializer=decode,
        response_serializer=ProcessingResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        EXTPROC_SERVICE, {"Process": handler}),))


def parse_body(path: str, body: bytes, header_model: str | None) -> Request | OpenAIError:
    """Pure parsing, module-level so a worker process can run it."""
    try:
        return openai.parse_request(path, body, header_model)
    except OpenAIError as err:
        return err


class Stream:
    __slots__ = ("_gw", "_rooms", "_room", "_path", "_strategy", "_request_id", "_header_model",
                 "_has_length", "_decision", "_done", "_expect_trailers", "_spec", "_session", "_queued",
                 "_one_message", "_traceparent", "_authorization", "_limiting", "_admission",
                 "_body", "_pool", "_subset", "_status", "_response_mode")

    def __init__(self, gateway: Gateway, rooms: Mapping[Waiting, LiveRoom] | None = None) -> None:
        self._gw = gateway
        self._rooms = rooms or {}  # where a request its strategy holds back waits (none: a 500)
        self._room: LiveRoom | None = None  # the room of this request's strategy, once it held it back
        self._path = ""
        self._strategy = ""
        self._spec: StrategySpec | None = None
        self._request_id = ""
        self._header_model: str | None = None
        self._session: str | None = None
        self._traceparent: str | None = None
        self._has_length = False
        self._decision: Routed | None = None
        self._done = False  # answered by the gateway, or routed
        self._expect_trailers = False  # an HTTP/2 body followed by trailers: reply to those too
        self._queued: tuple | None = None  # (request, profile, Queued, body, end_of_stream): SLO queue
        self._one_message = False  # the body came first, with the headers as attributes
        self._authorization: str | None = None  # whose rate-limit budget (hashed there; never logged)
        self._limiting: tuple | None = None  # (budget, request, body, end_of_stream): for Redis's answer
        self._admission: Admission | None = None  # the budget that admitted it (response headers)
        self._body: body.Reassembly | None = None  # a body that comes in pieces (body.py)
        self._pool = False  # attached as an InferencePool's picker: the response side comes too
        self._subset: frozenset[str] | None = None  # the data plane's subset hint, if it sent one
        self._status = 0  # the response's status, once its headers came (pool attachment)
        self._response_mode = body.BUFFERED  # how the response body comes, if at all (pool attachment)

    @property
    def decision(self) -> Routed | None:
        return self._decision

    @property
    def finished(self) -> bool:
        """Routed or answered: nothing more to do for this request (trailers are passed through). A
        pool's data plane reports on the response too: its stream stays open while the request runs."""
        return self._done and not self._expect_trailers and (self._decision is None or not self._pool)

    def handle(self, msg: ProcessingRequest,
               parsed: Request | OpenAIError | None = None) -> ProcessingResponse | list | None:
        """One ext_proc message in; its reply out, or None (a body piece held until the body ends), or
        a list (a streamed body's answers, in the order Envoy needs). `parsed` is the body already
        parsed off the loop."""
        kind = msg.WhichOneof("request")
        try:
            if msg is UNDECODABLE:
                raise openai.bad_request(f"a request header routing reads ({', '.join(attributes.HEADERS)}) "
                                         "is not valid UTF-8", code="invalid_header")
            if kind == "request_body":
                if self._body is not None:
                    return self._on_body_piece(msg.request_body, parsed)
                if not self._spec and not self._done and attributes.sent(msg):
                    self._one_message = True
                    if msg.protocol_config.request_body_mode not in body.ONE_MESSAGE_MODES:
                        self._attach(msg)  # a body in pieces, its headers not sent: this is the first
                        return self._first_piece(msg, parsed)
                    reply = self._start(attributes.headers(msg), end_of_stream=False)
                    if reply is not None:
                        return reply
                http_body = msg.request_body
                return self._on_request_body(http_body.body, http_body.end_of_stream, parsed)
            if kind == "request_headers":
                if msg.HasField("protocol_config"):
                    self._attach(msg)
                reply = self._on_request_headers(msg.request_headers)
                if reply is not None or self._done:
                    return reply
                pieces = self._body
                if pieces is not None and pieces.deferred_headers:
                    return None  # full duplex: the headers are answered with the route
                # A client must never choose the upstream: strip any destination header it sent.
                reply = responses.request_headers(self._gw.client_forbidden_headers)
                if pieces is not None and pieces.passes_pieces:  # STREAMED: the body buffered, if allowed
                    reply.mode_override.CopyFrom(body.BUFFER_THE_BODY[self._pool])
                return reply
            if kind == "request_trailers":
                self._expect_trailers = False
                if not self._done:
                    if self._body is not None and self._body.size:  # the body ended with trailers
                        return self._route_pieces(parsed, trailers=True)
                    raise openai.bad_request("request body is required", code="missing_body")  # HTTP/2
                return responses.CONTINUE_REQUEST_TRAILERS
            # The response side: a pool's data plane reports it; other bootstraps never send it.
            if kind == "response_headers":
                return self._on_response_headers(msg)
            if kind == "response_body":
                if self._response_mode == body.FULL_DUPLEX_STREAMED:  # every piece passed back as it came
                    return body.echo_response_body(msg.response_body)
                return responses.CONTINUE_RESPONSE_BODY
            if kind == "response_trailers":
                return responses.CONTINUE_RESPONSE_TRAILERS
            raise OpenAIError(500, f"unexpected ext_proc message {kind!r}", type="server_error")
        except OpenAIError as err:
            return self._reject(err)
        except Exception:  # a bug must cost one request, never the stream's bookkeeping
            log.exception("request %s: gateway error", self._request_id)
            return self._reject(OpenAIError(500, "internal gateway error", type="server_error"))

    def close(self, cancelled: bool) -> None:
        """The gRPC stream ended. Envoy closes it normally once routed; a cancelled stream (client gone
        while we routed) may never have used the decision, so its in-flight count is released now."""
        if self._decision is not None:
            if self._pool:  # the data plane held the stream for the whole request: it has ended
                # (Envoy may close it or reset it at the end: the response's status says it was used)
                if self._status:
                    self._gw.complete(self._decision.key, RequestEnd(self._status))
                else:  # no response at all: Envoy may never have used the decision
                    self._gw.abort(self._decision.key)
            elif cancelled:
                self._gw.abort(self._decision.key)
        elif not self._done:
            self._done = True
            self._gw.count("", "", self._strategy, "aborted")

    # -- request path ----------------------------------------------------------------------------

    def _attach(self, msg: ProcessingRequest) -> None:
        """The first message says how Envoy sends this request's body (protocol_config) and, with no
        attributes of our bootstrap, that an InferencePool's data plane is asking (subset hint)."""
        config = msg.protocol_config
        self._pool = not attributes.sent(msg)
        self._response_mode = config.response_body_mode
        if config.request_body_mode not in body.ONE_MESSAGE_MODES:
            self._body = body.Reassembly(config.request_body_mode,
                                         headers_sent=msg.HasField("request_headers"))
        if self._pool and msg.HasField("metadata_context"):
            self._subset = body.subset_hint(msg.metadata_context)

    def _first_piece(self, msg: ProcessingRequest,
                     parsed: Request | OpenAIError | None) -> ProcessingResponse | list | None:
        reply = self._start(attributes.headers(msg), end_of_stream=False)
        return reply if reply is not None else self._on_body_piece(msg.request_body, parsed)

    def _on_body_piece(self, http_body, parsed: Request | OpenAIError | None) -> ProcessingResponse | None:
        """A piece of a body sent in pieces: held until the body ends (bounded by max_body_bytes)."""
        if self._done:  # answered already (an error): Envoy sends nothing it expects an answer to
            return None
        limit = self._gw.config.max_body_bytes
        if not self._body.add(http_body.body, limit):  # type: ignore[union-attr]
            raise OpenAIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        if not http_body.end_of_stream:  # more pieces, or trailers, to come
            return responses.CONTINUE_REQUEST_BODY if self._body.passes_pieces else None  # type: ignore[union-attr]
        return self._route_pieces(parsed, trailers=False)

    def _route_pieces(self, parsed: Request | OpenAIError | None,
                      trailers: bool) -> ProcessingResponse | list | None:
        """The whole body is here: route it as a buffered one (the answer shaped for the mode)."""
        pieces = self._body
        pieces.trailers = trailers  # type: ignore[union-attr]
        return self._on_request_body(pieces.whole(), not trailers, parsed)  # type: ignore[union-attr]

    def _on_response_headers(self, msg: ProcessingRequest) -> ProcessingResponse:
        """A pool's data plane names the endpoint that served the request (a fallback, maybe): the
        request is accounted there. The status decides how the request ended, with the stream."""
        if self._decision is not None:
            for h in msg.response_headers.headers.headers:
                if h.key == ":status":
                    status = h.raw_value or h.value.encode()
                    self._status = int(status) if status.isdigit() else 0
                    break
            lb = msg.metadata_context.filter_metadata.get(LB_METADATA_NAMESPACE)
            if lb is not None and SERVED_KEY in lb.fields:
                self._gw.served_by(self._decision.key, lb.fields[SERVED_KEY].string_value)
        return responses.CONTINUE_RESPONSE_HEADERS

    def _on_request_headers(self, http_headers) -> ProcessingResponse | None:
        """The headers' checks: the gateway's own answer, or None (the request goes on)."""
        if len(http_headers.headers.headers) >= ENVOY_MAX_HEADERS:
            # The destination header would push the request over Envoy's limit, and Envoy would
            # answer the mutation with a misleading "gateway unavailable" 503.
            raise OpenAIError(431, f"too many request headers (at most {ENVOY_MAX_HEADERS - 1})",
                              code="request_header_fields_too_large")
        return self._start(_headers(http_headers), http_headers.end_of_stream)

    def _start(self, headers: dict[str, str], end_of_stream: bool) -> ProcessingResponse | None:
        """The checks of a request's headers (or of the attributes standing for them); a reply when
        the gateway answers the request itself, else None."""
        path = self._path = headers.get(":path", "").split("?", 1)[0]
        method = headers.get(":method", "")
        self._request_id = headers.get(ENVOY_REQUEST_ID_HEADER) or uuid.uuid4().hex
        self._header_model = headers.get(MODEL_HEADER)
        self._session = headers.get(SESSION_HEADER) or None
        self._traceparent = headers.get(TRACEPARENT_HEADER) if self._gw.spans is not None else None
        if self._session is not None and _header_bytes(self._session) > MAX_SESSION_KEY_BYTES:
            raise openai.bad_request(f"{SESSION_HEADER} is longer than {MAX_SESSION_KEY_BYTES} bytes",
                                     param=SESSION_HEADER, code="invalid_session_key")
        self._has_length = "content-length" in headers
        gw = self._gw
        gw.api_keys.check(headers.get(AUTHORIZATION_HEADER))
        self._authorization = headers.get(AUTHORIZATION_HEADER)

        if path == openai.MODELS_PATH:
            if method != "GET":
                raise OpenAIError(405, f"{method} {path}: only GET is allowed", code="method_not_allowed")
            self._done = True
            gw.count("", "", "", "200")
            return responses.immediate(200, openai.models_body(gw.pool.models()), self._reply_headers())
        if path not in gw.config.model_paths:
            # Only inference endpoints reach the engines; their admin endpoints stay out of reach.
            raise OpenAIError(404, f"{openai.quoted(path)} is not served by this gateway",
                              code="unknown_route")
        if method != "POST":
            raise OpenAIError(405, f"{method} {path}: only POST is allowed", code="method_not_allowed")
        if end_of_stream:
            raise openai.bad_request("request body is required", code="missing_body")
        try:
            spec = gw.strategy(headers.get(STRATEGY_HEADER))
        except StrategySpecError as exc:
            message = str(exc) if isinstance(exc, UnknownStrategy) else (  # it lists them already
                f"{exc}; valid strategies: {', '.join(strategy_names())}")
            raise openai.bad_request(message, param=STRATEGY_HEADER,
                                     code="unknown_routing_strategy") from None
        # Only now: metric labels and reply headers carry known names (sorted, no weights), never raw
        # client input.
        self._spec = spec
        self._strategy = spec.label
        return None

    def needs_offload(self, msg: ProcessingRequest) -> bool:
        if msg.WhichOneof("request") != "request_body":
            return False
        size = len(msg.request_body.body)
        if self._body is not None:  # only the piece that ends the body is parsed, all of it
            if not msg.request_body.end_of_stream or self._done:
                return False
            size += self._body.size
        return OFFLOAD_BODY_BYTES < size <= self._gw.config.max_body_bytes

    def parse_args(self, msg: ProcessingRequest) -> tuple[str, bytes, str | None]:
        """What the worker process parses: the body, its path and model header (from the attributes
        when the body is the request's first message)."""
        if not self._path and attributes.sent(msg):
            headers = attributes.headers(msg)
            path = headers.get(":path", "").split("?", 1)[0]
            return (path, msg.request_body.body, headers.get(MODEL_HEADER))
        if self._body is not None:
            return (self._path, self._body.peek(msg.request_body.body), self._header_model)
        return (self._path, msg.request_body.body, self._header_model)

    def _on_request_body(self, body: bytes, end_of_stream: bool,
                         parsed: Request | OpenAIError | None) -> ProcessingResponse:
        # BUFFERED mode sends the whole body in one message; end_of_stream is false only when request
        # trailers follow (HTTP/2), so this message is routed whatever that flag says.
        gw = self._gw
        if self._done:
            return responses.CONTINUE_REQUEST_BODY
        limit = gw.config.max_body_bytes
        if len(body) > limit:
            raise OpenAIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        request = parsed if parsed is not None else parse_body(self._path, body, self._header_model)
        if isinstance(request, OpenAIError):
            raise request
        if not gw.pool.has_model(request.model):
            raise OpenAIError(404, f"the model {openai.quoted(request.model)} does not exist",
                              param="model", code="model_not_found")
        if self._session is not None or self._traceparent is not None or self._subset is not None:
            request = replace(request, session_key=self._session, traceparent=self._traceparent,
                              endpoint_subset=self._subset)
        limiter = gw.limiter
        if limiter.enabled and (budget := limiter.budget(self._authorization, request)) is not None:
            if limiter.shared:  # Process awaits pass_limits() (no reply yet)
                self._limiting = (budget, request, body, end_of_stream)
                return None
            self._admission = limiter.admit_here(budget, request)
        return self._dispatch(request, body, end_of_stream)

    @property
    def limiting(self) -> bool:
        return self._limiting is not None

    async def pass_limits(self) -> ProcessingResponse | None:
        """The request's budget in Redis (one bounded round trip), then routing; or a 429.
        None: the request waits in the SLO queue next."""
        budget, request, body, end_of_stream = self._limiting
        self._limiting = None
        try:
            self._admission = await self._gw.limiter.admit_shared(budget, request)
            return self._dispatch(request, body, end_of_stream)
        except OpenAIError as err:
            return self._reject(err)
        except Exception:
            log.exception("request %s: rate limit error", self._request_id)
            return self._reject(OpenAIError(500, "internal gateway error", type="server_error"))

    def _dispatch(self, request: Request, body: bytes, end_of_stream: bool) -> ProcessingResponse | None:
        """Route the request, or hold it in its strategy's waiting room (None)."""
        gw = self._gw
        profile = gw.profile(self._spec, request.model)
        outcome = gw.route(request, profile, self._request_id)
        room = None
        if outcome.__class__ is not Routed:  # admission: the strategy's waiting room, if it held it back
            waiting = waiting_for(profile.name)
            room = self._room = self._rooms.get(waiting) if waiting is not None else None
            try:
                outcome = admission.admit(outcome, room)
            except admission.NoRoom:
                raise OpenAIError(500, "no waiting room for a held-back request",
                                  type="server_error") from None
        match outcome:
            case Routed() | None:  # None: no ready pod (a 503)
                return self._routed(outcome, request, body, end_of_stream, profile)
            case Queued():  # slo-least-load-pulling, slo: Process awaits wait_queued() (no reply yet)
                self._queued = (request, profile, outcome, body, end_of_stream)
                return None
            case Rejected():  # a 429: the strategy's, or the room's (full)
                assert room is not None  # admission refuses a held-back request only with a room
                raise room.reject(request.model, outcome)

    @property
    def queued(self) -> bool:
        return self._queued is not None

    async def wait_queued(self) -> ProcessingResponse:
        """Wait in the SLO queue (asynchronously: other streams go on); routed, or a 429."""
        request, profile, queued, body, end_of_stream = self._queued
        self._queued = None
        try:
            routed = await self._room.wait(request, profile, self._request_id, queued)  # type: ignore[union-attr]
            return self._routed(routed, request, body, end_of_stream, profile)
        except OpenAIError as err:
            return self._reject(err)
        except Exception:
            log.exception("request %s: SLO queue error", self._request_id)
            return self._reject(OpenAIError(500, "internal gateway error", type="server_error"))

    def _routed(self, decision: Routed | None, request: Request, body: bytes,
                end_of_stream: bool, profile: Profile) -> ProcessingResponse:
        gw = self._gw
        if decision is None:
            if self._subset is not None:  # the protocol's 503: none of the subset is eligible
                raise OpenAIError(503, f"no pod of model {request.model!r} in the data plane's subset "
                                  "hint is ready", type="service_unavailable", code="no_eligible_endpoint")
            raise OpenAIError(503, f"no ready pod for model {request.model!r}",
                              type="service_unavailable", code="no_ready_pod")
        self._decision = decision
        self._done = True
        if self._pool or self._body is not None:
            return self._routed_by_protocol(decision, request, body, end_of_stream, profile)
        # One message: trailers are not sent to the gateway (and Envoy sets a new body's length).
        self._expect_trailers = not end_of_stream and not self._one_message
        new_body = openai.with_usage_requested(body, request) if gw.config.include_usage else None
        trace = gw.spans.traceparent(request) if gw.spans is not None else None
        limits = responses.rate_limit_metadata(self._admission) if self._admission is not None else None
        if self._one_message:
            return responses.route_from_body(gw.config.destination_header, decision.pod, decision.key,
                                             self._request_id, self._strategy, new_body,
                                             gw.client_forbidden_headers, trace, limits)
        return responses.route(gw.config.destination_header, decision.pod, decision.key,
                               self._request_id, self._strategy, new_body, self._has_length, trace, limits)

    def _routed_by_protocol(self, decision: Routed, request: Request, raw: bytes, end_of_stream: bool,
                            profile: Profile) -> ProcessingResponse | list[ProcessingResponse]:
        """The endpoint-picker protocol's answer: to a pool's data plane, the pick and its next-best
        pods by the profile that picked it, in order, as the destination header and the envoy.lb
        value (one string); in the shape the body mode needs."""
        gw = self._gw
        endpoints = decision.pod.address
        if self._pool:
            fallbacks = gw.fallbacks(request, profile, decision.pod)
            endpoints = ",".join([endpoints, *(p.address for p in fallbacks)])
        pieces = self._body
        # No rewrite where nothing would strip the usage chunk again (a pool's data plane has no tally of
        # ours), nor where STREAMED pieces went on as they came.
        new_body = (openai.with_usage_requested(raw, request) if gw.config.include_usage and not self._pool
                    and (pieces is None or not pieces.passes_pieces) else None)
        trace = gw.spans.traceparent(request) if gw.spans is not None else None
        limits = responses.rate_limit_metadata(self._admission) if self._admission is not None else None
        route = responses.Route(gw.config.destination_header, endpoints, decision.pod, decision.key,
                                self._request_id, self._strategy, new_body, self._has_length,
                                gw.client_forbidden_headers, trace, limits, announce=self._pool)
        if pieces is None:  # buffered: one body message, answered with the route
            self._expect_trailers = not end_of_stream
            return route.body_answer()
        return pieces.answer(route, raw)

    def _reply_headers(self) -> list[tuple[str, str]]:
        headers = [(ROUTED_REQUEST_ID_HEADER, self._request_id)]
        if self._strategy:
            headers.append((STRATEGY_HEADER, self._strategy))
        return headers

    def _reject(self, err: OpenAIError) -> ProcessingResponse:
        if not self._done:
            self._done = True
            self._gw.count("", "", self._strategy, str(err.status))
        return responses.immediate(err.status, err.body(), [*self._reply_headers(), *err.headers])


class Processor(external_processor_pb2_grpc.ExternalProcessorServicer):
    """The gRPC face of the gateway: one ext_proc stream per HTTP request."""

    def __init__(self, gateway: Gateway, parser_pool: Executor | None = None,
                 rooms: Mapping[Waiting, LiveRoom] | None = None, heap: HeapTrimmer | None = None) -> None:
        self._gw = gateway
        self._pool = parser_pool
        self.heap = heap if heap is not None else HeapTrimmer()
        # the waiting rooms of the strategies that hold requests back (the slo* family's), as they
        # registered them: built at start, so their metrics show before the first queued request
        self.rooms = rooms if rooms is not None else {w: w.live(gateway) for w in waitings()}
        self.offloaded = Counter("extproc_bodies_parsed_off_loop", "Request bodies large enough to be "
                                 "parsed in a worker process, off the event loop", registry=gateway.registry)

    async def Process(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        """gRPC's entry, a coroutine: grpc.aio's read/write API. Its request iterator and reply
        generator wrap the same reads and writes in two more async-generator steps a message (a pool's
        stream is 4 messages in and 3 out)."""
        await self.serve(context.read, context.write)

    async def serve(self, read: Callable[[], Awaitable[Any]],
                    write: Callable[[ProcessingResponse], Awaitable[None]]) -> None:
        """One ext_proc stream: read until Envoy ends it (or the request is finished), write each reply."""
        stream = Stream(self._gw, self.rooms)
        self._gw.open_streams += 1
        cancelled, large = False, 0
        eof = grpc.aio.EOF
        try:
            while (msg := await read()) is not eof:
                parsed = None
                if self._pool is not None and stream.needs_offload(msg):
                    self.offloaded.inc()
                    large = len(msg.request_body.body)
                    parsed = await asyncio.get_running_loop().run_in_executor(
                        self._pool, parse_body, *stream.parse_args(msg))
                reply = stream.handle(msg, parsed)
                if reply is None and stream.limiting:
                    reply = await stream.pass_limits()
                if reply is None and stream.queued:
                    reply = await stream.wait_queued()
                if reply.__class__ is list:  # a body that came in pieces: one answer per piece
                    for one in reply:  # type: ignore[union-attr]
                        await write(one)
                elif reply is not None:  # None: a piece held until the body ends
                    await write(reply)
                if stream.finished:
                    # Close our side now: Envoy would otherwise hold this stream open for the whole
                    # response, and a gateway crash would then cut every running generation.
                    return
        except asyncio.CancelledError:
            # Envoy resets the stream when the request ends before this handler returned (a short
            # answer can finish while the routing reply's write is still completing): once that reply
            # was handed to gRPC, the request's access-log record accounts it. Only a stream cancelled
            # before it (the client gone while we routed or it waited) has nothing coming.
            cancelled = not stream.finished
            raise
        finally:
            stream.close(cancelled)
            self._gw.open_streams -= 1
            self.heap.saw_body(large)  # once its buffers are let go: worth a trim if large

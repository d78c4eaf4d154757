"""Builders for the ext_proc ProcessingResponse messages the gateway sends back to Envoy."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from extproc.envoy_contract import (
    ANSWERED_KEY,
    GATEWAY_METADATA_NAMESPACE,
    KEY,
    LB_METADATA_NAMESPACE,
    POD,
    RATE_LIMIT_BUCKET,
    RATE_LIMIT_TOKENS,
    REQUEST_ID,
    STRATEGY,
    STRIP_USAGE,
    TRACEPARENT,
)
from extproc.pool.pod import Pod
from extproc.ratelimit import Admission

OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

# Stateless replies are built once: they are sent for every streamed response chunk.
CONTINUE_REQUEST_BODY = ProcessingResponse(request_body=BodyResponse())
CONTINUE_RESPONSE_HEADERS = ProcessingResponse(response_headers=HeadersResponse())
CONTINUE_RESPONSE_BODY = ProcessingResponse(response_body=BodyResponse())
CONTINUE_REQUEST_TRAILERS = ProcessingResponse(request_trailers=TrailersResponse())
CONTINUE_RESPONSE_TRAILERS = ProcessingResponse(response_trailers=TrailersResponse())


# Marks the gateway's own answers, so Envoy's local-reply mapper leaves them alone.
_ANSWERED_BY_GATEWAY = Struct()
_ANSWERED_BY_GATEWAY.fields[GATEWAY_METADATA_NAMESPACE].struct_value.fields[ANSWERED_KEY].bool_value = True


def _set(headers: Iterable[tuple[str, str]]) -> list[HeaderValueOption]:
    return [HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode()), append_action=OVERWRITE)
            for k, v in headers]


def request_headers(remove: list[str]) -> ProcessingResponse:
    """Continue with the headers, minus those a client must not set (destination headers).

    clear_route_cache: a route Envoy may already have matched on the client's header is dropped too.
    """
    return ProcessingResponse(request_headers=HeadersResponse(response=CommonResponse(
        header_mutation=HeaderMutation(remove_headers=remove), clear_route_cache=True)))


def route(destination_header: str, pod: Pod, key: str, request_id: str, strategy: str,
          new_body: bytes | None, has_content_length: bool,
          traceparent: str | None = None,
          limits: list[tuple[str, str]] | None = None) -> ProcessingResponse:
    """Send the buffered request to the pod: the header ORIGINAL_DST follows, envoy.lb metadata (the
    endpoint-picker protocol), and our own metadata for the response side.

    clear_route_cache makes Envoy re-match routes now that the destination header exists.
    `new_body` replaces the request body (usage requested on the client's behalf); its length is set
    when the client sent one, as Envoy refuses a mutated body that disagrees with content-length.
    `limits`: the request's rate-limit budget (`rate_limit_metadata`).
    """
    metadata = _decision(destination_header, pod, key, request_id, strategy, new_body is not None,
                         traceparent, limits)
    headers = [(destination_header, pod.address)]
    if traceparent:  # also as a header: Envoy Gateway's route does not add it from the metadata
        headers.append((TRACEPARENT, traceparent))
    mutation = None
    if new_body is not None:
        mutation = BodyMutation(body=new_body)
        if has_content_length:
            headers.append(("content-length", str(len(new_body))))
    return ProcessingResponse(
        request_body=BodyResponse(response=CommonResponse(
            header_mutation=HeaderMutation(set_headers=_set(headers)), body_mutation=mutation,
            clear_route_cache=True)),
        dynamic_metadata=metadata)


def route_from_body(destination_header: str, pod: Pod, key: str, request_id: str, strategy: str,
                    new_body: bytes | None, remove: list[str], traceparent: str | None = None,
                    limits: list[tuple[str, str]] | None = None) -> ProcessingResponse:
    """`route` for a request whose headers Envoy did not send (one message: the body). Envoy (1.40)
    applies no header mutation then: the destination is the envoy.lb metadata, which the route and
    the ORIGINAL_DST cluster follow, and the route itself sets the destination header and strips
    client-sent ones (envoy_bootstrap.py); it also sets a new body's content-length. The header
    mutation is there because Envoy clears the route cache only for a response that has one."""
    metadata = _decision(destination_header, pod, key, request_id, strategy, new_body is not None,
                         traceparent, limits)
    return ProcessingResponse(
        request_body=BodyResponse(response=CommonResponse(
            header_mutation=HeaderMutation(remove_headers=remove),
            body_mutation=BodyMutation(body=new_body) if new_body is not None else None,
            clear_route_cache=True)),
        dynamic_metadata=metadata)


@dataclass(slots=True)
class Route:
    """A routing decision for the endpoint-picker protocol's data plane, answered in the message the
    body mode calls for. `endpoints`: the pick, then its fallbacks ("ip:port,ip:port"), the same
    string in the destination header and the envoy.lb value (the protocol forbids two values)."""

    destination_header: str
    endpoints: str
    pod: Pod
    key: str
    request_id: str
    strategy: str
    body: bytes | None  # the rewritten body, or None: unchanged
    has_content_length: bool
    remove: list[str]  # the headers a client must not set
    traceparent: str | None = None
    limits: list[tuple[str, str]] | None = None
    # The destination header too (a pool's data plane may follow either); our own bootstrap's route
    # sets it from the metadata, as on the one-message path.
    announce: bool = True

    def metadata(self) -> Struct:
        return _decision(self.destination_header, self.pod, self.key, self.request_id, self.strategy,
                         self.body is not None, self.traceparent, self.limits, self.endpoints)

    def _mutation(self, content_length: int | None) -> HeaderMutation:
        headers = [(self.destination_header, self.endpoints)] if self.announce else []
        if self.traceparent and self.announce:
            headers.append((TRACEPARENT, self.traceparent))
        if content_length is not None and self.has_content_length:
            headers.append(("content-length", str(content_length)))
        if not headers:
            return HeaderMutation(remove_headers=self.remove)
        return HeaderMutation(set_headers=_set(headers), remove_headers=self.remove)

    def body_answer(self) -> ProcessingResponse:
        """BUFFERED: the body's answer carries the destination, and the rewritten body if any."""
        return ProcessingResponse(request_body=BodyResponse(response=CommonResponse(
            header_mutation=self._mutation(len(self.body) if self.body is not None else None),
            body_mutation=BodyMutation(body=self.body) if self.body is not None else None,
            clear_route_cache=True)), dynamic_metadata=self.metadata())

    def piece_answer(self) -> ProcessingResponse:
        """STREAMED, the last piece: passed on as it came. Envoy applies no header mutation to a
        streamed piece, but clears its route cache only for an answer that has one."""
        return ProcessingResponse(request_body=BodyResponse(response=CommonResponse(
            header_mutation=self._mutation(None), clear_route_cache=True)), dynamic_metadata=self.metadata())

    def trailers_answer(self) -> ProcessingResponse:
        """STREAMED, a body ended by trailers: the destination comes with the trailers' answer."""
        return ProcessingResponse(request_trailers=TrailersResponse(), dynamic_metadata=self.metadata())

    def streamed_answer(self, data: bytes, end_of_stream: bool) -> ProcessingResponse:
        """FULL_DUPLEX_STREAMED without a headers message (our bootstrap): the whole body as one
        streamed piece, with the route's metadata, which ORIGINAL_DST reads when the request reaches
        the router; no route-cache refresh (Envoy passes the data on first, and refuses to clear a
        route cache once the headers reached the router: envoy_bootstrap.py routes it already)."""
        answer = ProcessingResponse(dynamic_metadata=self.metadata())
        piece = answer.request_body.response.body_mutation.streamed_response
        piece.body = data
        piece.end_of_stream = end_of_stream
        return answer

    def headers_answer(self, body_length: int) -> ProcessingResponse:
        """FULL_DUPLEX_STREAMED: the held request headers, answered once the body has ended."""
        # the length only when the body changed; unchanged, it goes on without one: Envoy (1.40)
        # drops a full-duplex body's content-length, forwards it chunked, and ignores a length set here
        return ProcessingResponse(request_headers=HeadersResponse(response=CommonResponse(
            header_mutation=self._mutation(body_length if self.body is not None else None),
            clear_route_cache=True)), dynamic_metadata=self.metadata())


def rate_limit_metadata(admission: Admission) -> list[tuple[str, str]]:
    """An admitted request's budget as metadata: the x-ratelimit-* values Envoy adds to the response
    (each under its header's name), and where the access log's output tokens are charged."""
    return [*admission.headers(), (RATE_LIMIT_BUCKET, admission.bucket_id),
            (RATE_LIMIT_TOKENS, str(admission.limits.tokens or 0))]


def _decision(destination_header: str, pod: Pod, key: str, request_id: str, strategy: str,
              strip_usage: bool, traceparent: str | None = None,
              limits: list[tuple[str, str]] | None = None, endpoints: str | None = None) -> Struct:
    """The routing decision as dynamic metadata: envoy.lb (the endpoint-picker protocol) and ours
    (with the span's traceparent, which the route sets on the request to the pod, and the rate-limit
    headers Envoy adds to the response)."""
    metadata = Struct()
    metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[destination_header].string_value = \
        endpoints or pod.address
    ours = metadata.fields[GATEWAY_METADATA_NAMESPACE].struct_value.fields
    ours[KEY].string_value = key
    ours[POD].string_value = pod.name
    ours[STRATEGY].string_value = strategy
    ours[REQUEST_ID].string_value = request_id
    if strip_usage:
        ours[STRIP_USAGE].bool_value = True
    if traceparent:
        ours[TRACEPARENT].string_value = traceparent
    for name, value in limits or ():
        ours[name].string_value = value
    return metadata


def immediate(status: int, body: bytes, headers: Iterable[tuple[str, str]] = (),
              content_type: str = "application/json") -> ProcessingResponse:
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=status), body=body,
            headers=HeaderMutation(set_headers=_set([("content-type", content_type), *headers]))),
        dynamic_metadata=_ANSWERED_BY_GATEWAY)

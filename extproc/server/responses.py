"""Builders for the ext_proc ProcessingResponse messages the gateway sends back to Envoy."""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import (
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

OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
LB_METADATA_NAMESPACE = "envoy.lb"  # the endpoint-picker protocol's metadata namespace
GATEWAY_METADATA_NAMESPACE = "extproc"
ANSWERED_KEY = "answered"

# Stateless replies are built once: they are sent for every streamed response chunk.
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


def route(destination_header: str, address: str) -> ProcessingResponse:
    """Send the buffered request to `address`: the header ORIGINAL_DST follows, plus envoy.lb metadata.

    clear_route_cache makes Envoy re-match routes now that the destination header exists.
    """
    metadata = Struct()
    metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[destination_header].string_value = address
    return ProcessingResponse(
        request_body=BodyResponse(response=CommonResponse(
            header_mutation=HeaderMutation(set_headers=_set([(destination_header, address)])),
            clear_route_cache=True)),
        dynamic_metadata=metadata)


def response_headers(headers: Iterable[tuple[str, str]]) -> ProcessingResponse:
    return ProcessingResponse(response_headers=HeadersResponse(
        response=CommonResponse(header_mutation=HeaderMutation(set_headers=_set(headers)))))


def immediate(status: int, body: bytes, headers: Iterable[tuple[str, str]] = (),
              content_type: str = "application/json") -> ProcessingResponse:
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=status), body=body,
            headers=HeaderMutation(set_headers=_set([("content-type", content_type), *headers]))),
        dynamic_metadata=_ANSWERED_BY_GATEWAY)

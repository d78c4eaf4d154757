"""What routing reads from a request's headers, as Envoy sends it when the headers themselves are not sent.

A request with a body reaches the gateway as one ext_proc message: its buffered body, with these
attributes (Envoy's CEL attributes, one expression each; a header the request lacks is left out).
`envoy_bootstrap` asks Envoy for them; `processor` reads them back as the headers they stand for.
"""

from __future__ import annotations

from collections.abc import Mapping

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from extproc.envoy_contract import (
    AUTHORIZATION_HEADER,
    ENVOY_REQUEST_ID_HEADER,
    MODEL_HEADER,
    SESSION_HEADER,
    STRATEGY_HEADER,
    TRACEPARENT_HEADER,
)

FILTER = "envoy.filters.http.ext_proc"  # the key Envoy files the attributes under

# The request's headers routing reads (processor.WANTED_HEADERS without the pseudo-headers and
# x-request-id, which have attributes of their own; content-length: Envoy resets it on a new body).
HEADERS = (MODEL_HEADER, STRATEGY_HEADER, AUTHORIZATION_HEADER, SESSION_HEADER, TRACEPARENT_HEADER)
# attribute -> the header name the processor knows it by
_NAMED = {"request.path": ":path", "request.method": ":method", "request.id": ENVOY_REQUEST_ID_HEADER}
ATTRIBUTES = (*_NAMED, *(f"request.headers['{h}']" for h in HEADERS))
_AS_HEADER = {**_NAMED, **{f"request.headers['{h}']": h for h in HEADERS}}


def sent(msg: ProcessingRequest) -> bool:
    """Whether this message carries the request's attributes (it came without a headers message)."""
    return FILTER in msg.attributes


def headers(msg: ProcessingRequest) -> Mapping[str, str]:
    """The attributes as the headers they stand for (`:path`, `:method`, `x-request-id`, ...)."""
    fields = msg.attributes[FILTER].fields
    return {_AS_HEADER[name]: value.string_value for name, value in fields.items() if name in _AS_HEADER}

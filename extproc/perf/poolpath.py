"""The endpoint-picker protocol's request in process, for before/after timing and profiling of the
picker's own work: the four messages a pool's data plane sends (request headers with a full-duplex
body mode, the body, its end as an empty piece, the response headers naming the served endpoint), each
answer serialized, the stream closed. No gRPC, no Envoy.

    python extproc/perf/poolpath.py [N] [PODS]          # this checkout
    PYTHONPATH=<an earlier checkout> python extproc/perf/poolpath.py 20000 4

Run as a file (an earlier checkout's `extproc`, first on PYTHONPATH, is what it times); pair two with
`farm-bench --vs` (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import sys

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProtocolConfiguration,
)

from extproc.config import parse
from extproc.server.gateway import Gateway
from extproc.server.processor import Stream, decode

SERVED = "x-gateway-destination-endpoint-served"


def messages(served: str) -> list[bytes]:
    """The pool's four messages, as bytes off the wire."""
    pairs = {":path": "/v1/chat/completions", ":method": "POST", "x-request-id": "poolpath",
             "content-type": "application/json"}
    head = ProcessingRequest(
        request_headers=HttpHeaders(headers=HeaderMap(
            headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])),
        protocol_config=ProtocolConfiguration(request_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED))
    body = json.dumps({"model": "m", "max_tokens": 16,
                       "messages": [{"role": "user", "content": "hello " * 10}]}).encode()
    response = ProcessingRequest(response_headers=HttpHeaders(headers=HeaderMap(
        headers=[HeaderValue(key=":status", raw_value=b"200")])))
    response.metadata_context.filter_metadata["envoy.lb"].fields[SERVED].string_value = served
    return [m.SerializeToString() for m in (
        head, ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=False)),
        ProcessingRequest(request_body=HttpBody(body=b"", end_of_stream=True)), response)]


def main(n: int, pods: int) -> None:
    gw = Gateway(parse({"models": {"m": {"pods": [
        {"name": f"p{i}", "address": f"10.0.0.{i}:8000"} for i in range(1, pods + 1)]}}}, {}))
    data = messages("10.0.0.1:8000")
    for _ in range(n):
        stream = Stream(gw)
        for raw in data:
            answer = stream.handle(decode(raw))
            replies = answer if isinstance(answer, list) else [answer] if answer is not None else []
            for reply in replies:
                reply.SerializeToString()
        stream.close(False)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000, int(sys.argv[2]) if len(sys.argv) > 2 else 1)

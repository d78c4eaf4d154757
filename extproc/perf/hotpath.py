"""The buffered one-message hot path in process, for before/after timing of the request side.

    python extproc/perf/hotpath.py 30000                       # this checkout
    PYTHONPATH=<an earlier checkout> python extproc/perf/hotpath.py 30000   # that one's code

`Stream.handle` on the message Envoy sends (the body with the headers as attributes), the reply
serialized, the stream closed and the request completed (its access-log record), N times. Run as a file,
not a module, so that an earlier checkout's `extproc` (first on PYTHONPATH) is what it times; it uses only
what every version since the one-message path has. Pair the two with `farm-bench --vs` (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import sys

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    ProcessingRequest,
    ProtocolConfiguration,
)

from extproc.config import parse
from extproc.server.attributes import FILTER
from extproc.server.gateway import Gateway
from extproc.server.processor import Stream, decode

try:  # the finished request as one value (since issue 42); earlier checkouts took keywords
    from extproc.vocabulary import RequestEnd

    def complete(gw: Gateway, key: str) -> None:
        gw.complete(key, RequestEnd(200))
except ImportError:
    def complete(gw: Gateway, key: str) -> None:
        gw.complete(key, status=200)  # type: ignore[call-arg]


def one_message() -> bytes:
    body = json.dumps({"model": "m", "max_tokens": 16,
                       "messages": [{"role": "user", "content": "hello " * 10}]}).encode()
    msg = ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True),
                            protocol_config=ProtocolConfiguration(request_body_mode=ProcessingMode.BUFFERED))
    for key, value in {"request.path": "/v1/chat/completions", "request.method": "POST",
                       "request.id": "hotpath"}.items():
        msg.attributes[FILTER].fields[key].string_value = value
    return msg.SerializeToString()


def main(n: int) -> None:
    gw = Gateway(parse({"models": {"m": {"pods": [
        {"name": f"p{i}", "address": f"10.0.0.{i}:8000"} for i in range(1, 5)]}}}, {}))
    data = one_message()
    for _ in range(n):
        stream = Stream(gw)
        stream.handle(decode(data)).SerializeToString()
        stream.close(False)
        complete(gw, stream.decision.key)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30_000)

"""The floor under the `pool` benchmark path: a picker that does nothing but the protocol's messages.

Behind the same Envoy as the `pool` path (`extproc envoy-config --pool`, full-duplex body), it answers
each message with a fixed reply through grpc.aio's read/write API, as the gateway does: nothing parsed,
nothing routed, one endpoint always. Between it and the buffered path (c) is what the protocol's
message count costs (4 in and 3 out per request against 1 and 1); between it and `pool` is the
gateway's own work.

    python -m extproc.perf.pool_floor --port 50061 --endpoint 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse

from extproc.envoy_contract import DEFAULT_DESTINATION_HEADER, EXTPROC_SERVICE, LB_METADATA_NAMESPACE
from extproc.server import body, responses


def headers_answer(endpoint: str) -> ProcessingResponse:
    """The held request headers' answer: the endpoint in the header and in envoy.lb, route re-matched."""
    answer = ProcessingResponse()
    common = answer.request_headers.response
    common.clear_route_cache = True
    header = common.header_mutation.set_headers.add().header
    header.key, header.raw_value = DEFAULT_DESTINATION_HEADER, endpoint.encode()
    lb = answer.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value
    lb.fields[DEFAULT_DESTINATION_HEADER].string_value = endpoint
    return answer


class FloorPicker:
    def __init__(self, endpoint: str) -> None:
        self._headers = headers_answer(endpoint)

    async def Process(self, request_iterator, context) -> None:  # noqa: N802 (gRPC method name)
        pieces: list[bytes] = []
        eof = grpc.aio.EOF
        while (msg := await context.read()) is not eof:
            kind = msg.WhichOneof("request")
            if kind == "request_body":
                pieces.append(msg.request_body.body)
                if msg.request_body.end_of_stream:
                    await context.write(self._headers)
                    await context.write(body.streamed_piece(b"".join(pieces), True))
            elif kind == "request_trailers":
                await context.write(self._headers)
                await context.write(body.streamed_piece(b"".join(pieces), False))
                await context.write(responses.CONTINUE_REQUEST_TRAILERS)
            elif kind == "response_headers":
                await context.write(responses.CONTINUE_RESPONSE_HEADERS)
            elif kind == "response_trailers":
                await context.write(responses.CONTINUE_RESPONSE_TRAILERS)
            elif kind == "response_body":
                await context.write(body.echo_response_body(msg.response_body))


async def serve(port: int, endpoint: str) -> None:
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        FloorPicker(endpoint).Process, request_deserializer=ProcessingRequest.FromString,
        response_serializer=ProcessingResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        EXTPROC_SERVICE, {"Process": handler}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoint", required=True, help="ip:port every request is sent to")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.endpoint))


if __name__ == "__main__":
    main()

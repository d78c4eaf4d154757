"""A request body that Envoy sends in pieces (STREAMED, FULL_DUPLEX_STREAMED), and the answer each mode needs.

BUFFERED and BUFFERED_PARTIAL send the body as one message (past Envoy's buffer BUFFERED_PARTIAL sends a
part, which is over max_body_bytes: a 413): the processor routes that message as it always did, and no
Reassembly exists. The streamed modes send pieces, and routing needs the whole body:

- STREAMED: Envoy waits for the answer to each piece before it sends trailers, so pieces are answered as
  they come, unchanged (the include_usage rewrite is not applied: the body passes through as the client
  sent it); the piece that ends the body carries the route (metadata, and the header mutation whose
  presence lets Envoy clear its route cache), or the trailers' answer does when trailers end it.
- FULL_DUPLEX_STREAMED: nothing is answered until the body has ended (its last piece, or the trailers);
  then, in order, the request headers' answer with the destination (the headers were held for it), the
  whole body as one streamed piece (rewritten as in BUFFERED mode, if at all), and the trailers' answer.

Pieces are kept until the body ends, bounded by max_body_bytes as a buffered body is.
"""

from __future__ import annotations

from envoy.config.core.v3.base_pb2 import Metadata
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HttpBody,
    ProcessingResponse,
    StreamedBodyResponse,
)

from extproc.envoy_contract import SUBSET_HINT_NAMESPACE, SUBSET_KEY
from extproc.server import responses

STREAMED = ProcessingMode.STREAMED
BUFFERED = ProcessingMode.BUFFERED
BUFFERED_PARTIAL = ProcessingMode.BUFFERED_PARTIAL
FULL_DUPLEX_STREAMED = ProcessingMode.FULL_DUPLEX_STREAMED
# STREAMED pieces pass the headers on before the body is known: a route that follows the pick cannot be
# chosen again (Envoy refuses a route-cache refresh then, and a load balancer has picked already). The
# headers' answer asks for the body buffered instead, which Envoy grants where allow_mode_override is set
# (Envoy AI Gateway sets it; so does `extproc envoy-config`); elsewhere the pieces come and are answered.
# The rest of the mode as it was: the response headers come to a pool's picker only.
BUFFER_THE_BODY = {pool: ProcessingMode(
    request_header_mode=ProcessingMode.SEND, request_body_mode=BUFFERED,
    request_trailer_mode=ProcessingMode.SEND,
    response_header_mode=ProcessingMode.SEND if pool else ProcessingMode.SKIP,
    response_trailer_mode=ProcessingMode.SEND if pool else ProcessingMode.SKIP) for pool in (False, True)}
# Modes whose body is one message: routed as it comes (BUFFERED_PARTIAL holds the headers as BUFFERED does).
ONE_MESSAGE_MODES = frozenset({ProcessingMode.NONE, BUFFERED, BUFFERED_PARTIAL})


class Reassembly:
    """The pieces of one request body, until it ends."""

    __slots__ = ("mode", "pieces", "size", "trailers", "headers_sent")

    def __init__(self, mode: int, headers_sent: bool = True) -> None:
        self.mode = mode
        self.headers_sent = headers_sent  # False: our bootstrap's one message path (headers as attributes)
        self.pieces: list[bytes] = []
        self.size = 0
        self.trailers = False  # the body was ended by the request's trailers

    @property
    def deferred_headers(self) -> bool:
        """Full duplex: the request headers are answered with the route, once the body has ended."""
        return self.mode == FULL_DUPLEX_STREAMED and self.headers_sent

    @property
    def passes_pieces(self) -> bool:
        """STREAMED: each piece is answered (passed on unchanged) as it comes."""
        return self.mode == STREAMED

    def add(self, piece: bytes, limit: int) -> bool:
        """Keep a piece; False once the body is over `limit` bytes (the pieces are let go)."""
        self.size += len(piece)
        if self.size > limit:
            self.pieces.clear()
            return False
        if piece:
            self.pieces.append(piece)
        return True

    def peek(self, last: bytes) -> bytes:
        """The whole body with its last piece, not yet added (parsed in a worker process)."""
        return b"".join([*self.pieces, last])

    def whole(self) -> bytes:
        """The body, for the processor's buffered path (most bodies are one piece: no copy)."""
        return self.pieces[0] if len(self.pieces) == 1 else b"".join(self.pieces)

    def answer(self, route: responses.Route, raw: bytes) -> ProcessingResponse | list[ProcessingResponse]:
        """The route in the shape this mode needs, once the body has ended."""
        if self.mode == FULL_DUPLEX_STREAMED:
            out = route.body if route.body is not None else raw
            if not self.headers_sent:  # our bootstrap: the route with the body (envoy_bootstrap.py)
                return route.streamed_answer(out, not self.trailers)
            else:
                answers = [route.headers_answer(len(out)), streamed_piece(out, not self.trailers)]
            if self.trailers:
                answers.append(responses.CONTINUE_REQUEST_TRAILERS)
            return answers
        # STREAMED: the earlier pieces went on unchanged; so does this one
        return route.trailers_answer() if self.trailers else route.piece_answer()


def streamed_piece(data: bytes, end_of_stream: bool) -> ProcessingResponse:
    """A full-duplex body answer: this data goes on in place of what came."""
    answer = ProcessingResponse()
    piece = answer.request_body.response.body_mutation.streamed_response
    piece.body = data
    piece.end_of_stream = end_of_stream
    return answer


def echo_response_body(http_body: HttpBody) -> ProcessingResponse:
    """A full-duplex response piece passed back as it came (the gateway reads nothing of it)."""
    return ProcessingResponse(response_body=BodyResponse(response=CommonResponse(body_mutation=BodyMutation(
        streamed_response=StreamedBodyResponse(body=http_body.body, end_of_stream=http_body.end_of_stream)))))


def subset_hint(metadata: Metadata) -> frozenset[str] | None:
    """The data plane's subset hint (endpoint-picker protocol): the endpoints the pick must come from,
    as a list or a comma-separated string; None when it sent none (every pod of the pool is eligible).
    An empty list is a hint too: nothing is eligible."""
    hint = metadata.filter_metadata.get(SUBSET_HINT_NAMESPACE)
    if hint is None or SUBSET_KEY not in hint.fields:
        return None
    value = hint.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    items = ([v.string_value for v in value.list_value.values] if kind == "list_value"
             else [value.string_value] if kind == "string_value" else [])
    return frozenset(e.strip() for item in items for e in item.split(",") if e.strip())

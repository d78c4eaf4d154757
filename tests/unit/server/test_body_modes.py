"""The ext_proc state machine in every request body mode, and the endpoint-picker protocol's parts
(subset hint, fallback list, served endpoint, the response side of a pool's data plane), over fake
message sequences as Envoy sends them. Through real Envoy: tests/integration/test_body_modes.py and
tests/conformance/."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProtocolConfiguration,
)
from google.protobuf.struct_pb2 import Struct
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.config import parse
from extproc.server.attributes import FILTER
from extproc.server.gateway import Gateway
from extproc.server.processor import Stream
from extproc.vocabulary import RequestEnd

PODS = [{"name": f"p{i}", "address": f"10.0.0.{i + 1}:8000"} for i in range(4)]
CONFIG = {"models": {"m": {"pods": PODS}}, "gateway": {"max_body_bytes": 1000},
          "routing": {"default_strategy": "least-request"}}
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}]}).encode()
STREAM_CHAT = json.dumps({"model": "m", "stream": True,
                          "messages": [{"role": "user", "content": "hello there"}]}).encode()
FULL_DUPLEX, STREAMED = ProcessingMode.FULL_DUPLEX_STREAMED, ProcessingMode.STREAMED
BUFFERED, BUFFERED_PARTIAL = ProcessingMode.BUFFERED, ProcessingMode.BUFFERED_PARTIAL
DEST = "x-gateway-destination-endpoint"


@pytest.fixture
def gw() -> Gateway:
    return Gateway(parse(CONFIG, {}))


def headers(mode: int, *, ours: bool = False, subset: object = None, length: int | None = None,
            **extra: str) -> ProcessingRequest:
    """The first message: request headers, with the protocol config Envoy sends on it; `ours`: our
    bootstrap's attributes too; `subset`: the data plane's subset hint in the request's metadata."""
    pairs = {":path": "/v1/chat/completions", ":method": "POST", "x-request-id": "rid", **extra}
    if length is not None:
        pairs["content-length"] = str(length)
    msg = ProcessingRequest(
        request_headers=HttpHeaders(headers=HeaderMap(
            headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])),
        protocol_config=ProtocolConfiguration(request_body_mode=mode))
    if ours:
        msg.attributes[FILTER].fields["request.path"].string_value = "/v1/chat/completions"
    if subset is not None:
        hint = Struct()
        if isinstance(subset, list):
            hint.fields["x-gateway-destination-endpoint-subset"].list_value.extend(subset)
        else:
            hint.fields["x-gateway-destination-endpoint-subset"].string_value = subset
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return msg


def piece(data: bytes, eos: bool) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=data, end_of_stream=eos))


def pieces(data: bytes, size: int = 7) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def response_headers(status: str = "200", served: str | None = None) -> ProcessingRequest:
    msg = ProcessingRequest(response_headers=HttpHeaders(headers=HeaderMap(
        headers=[HeaderValue(key=":status", raw_value=status.encode())])))
    if served is not None:
        msg.metadata_context.filter_metadata["envoy.lb"].fields[
            "x-gateway-destination-endpoint-served"].string_value = served
    return msg


def running(gw: Gateway) -> dict[str, int]:
    return {p.name: gw.accounting.shared.local_running(p.key) for p in gw.pool.all_pods()}


def set_headers(common) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def feed(s: Stream, data: bytes, *, trailers: bool = False) -> list:
    """All pieces of a body, then the trailers if any: every answer the stream gave, in order."""
    out = []
    parts = pieces(data)
    for i, part in enumerate(parts):
        out.append(s.handle(piece(part, eos=not trailers and i == len(parts) - 1)))
    if trailers:
        out.append(s.handle(ProcessingRequest(request_trailers=HttpTrailers())))
    flat = []
    for r in out:
        flat.extend(r if isinstance(r, list) else [r])
    return flat


def test_full_duplex_holds_everything_until_the_body_ends_then_answers_headers_body_in_order(gw: Gateway):
    s = Stream(gw)
    assert s.handle(headers(FULL_DUPLEX, length=len(CHAT))) is None  # the headers wait for the pick
    parts = pieces(CHAT)
    for part in parts[:-1]:
        assert s.handle(piece(part, eos=False)) is None
    answers = s.handle(piece(parts[-1], eos=True))
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    route = answers[0].request_headers.response
    assert route.clear_route_cache
    sent = set_headers(route)
    assert "content-length" not in sent  # the body goes on unchanged: the client's length stands
    assert {DEST, "target-pod"} <= set(route.header_mutation.remove_headers)  # a client's are dropped
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == CHAT and streamed.end_of_stream  # the body goes on unchanged, whole
    lb = answers[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    assert lb == sent[DEST]  # the protocol: one value in the header and the metadata
    assert sum(running(gw).values()) == 1


def test_full_duplex_body_ended_by_trailers(gw: Gateway):
    s = Stream(gw)
    s.handle(headers(FULL_DUPLEX))
    answers = feed(s, CHAT, trailers=True)
    kinds = [a.WhichOneof("response") for a in answers if a is not None]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    streamed = answers[-2].request_body.response.body_mutation.streamed_response
    assert streamed.body == CHAT and not streamed.end_of_stream  # trailers follow the body


def test_full_duplex_rewrite_is_the_buffered_one_with_its_length(gw: Gateway):
    s = Stream(gw)
    s.handle(headers(FULL_DUPLEX, ours=True, length=len(STREAM_CHAT)))
    answers = [a for a in feed(s, STREAM_CHAT) if a is not None]
    out = answers[1].request_body.response.body_mutation.streamed_response.body
    assert json.loads(out)["stream_options"] == {"include_usage": True}
    assert set_headers(answers[0].request_headers.response)["content-length"] == str(len(out))


def test_a_pools_body_is_never_rewritten(gw: Gateway):
    """A pool's data plane has no tally of ours to strip the usage chunk again: the body goes on as sent."""
    s = Stream(gw)
    s.handle(headers(FULL_DUPLEX, length=len(STREAM_CHAT)))
    answers = [a for a in feed(s, STREAM_CHAT) if a is not None]
    assert answers[1].request_body.response.body_mutation.streamed_response.body == STREAM_CHAT
    assert "strip_usage" not in answers[0].dynamic_metadata.fields["extproc"].struct_value.fields


def test_streamed_pieces_pass_on_unchanged_and_the_last_carries_the_route(gw: Gateway):
    s = Stream(gw)
    first = s.handle(headers(STREAMED, ours=True))
    # the body is asked for buffered (Envoy grants it where allow_mode_override is set)
    assert first.mode_override.request_body_mode == BUFFERED
    assert first.mode_override.response_header_mode == ProcessingMode.SKIP  # our bootstrap's
    answers = feed(s, STREAM_CHAT)
    assert all(a.request_body.response.ByteSize() == 0 for a in answers[:-1])  # passed on as they came
    last = answers[-1]
    assert last.request_body.response.clear_route_cache
    assert not last.request_body.response.HasField("body_mutation")
    assert last.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    assert "strip_usage" not in last.dynamic_metadata.fields["extproc"].struct_value.fields
    assert s.finished  # our bootstrap: the stream closes once routed


def test_streamed_body_ended_by_trailers_routes_with_the_trailers(gw: Gateway):
    s = Stream(gw)
    s.handle(headers(STREAMED, ours=True))
    answers = feed(s, CHAT, trailers=True)
    assert answers[-1].HasField("request_trailers")
    assert answers[-1].dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    assert sum(running(gw).values()) == 1


@pytest.mark.parametrize("mode", [BUFFERED, BUFFERED_PARTIAL])
def test_one_message_modes_route_the_one_body_message(gw: Gateway, mode: int):
    s = Stream(gw)
    s.handle(headers(mode, ours=True))
    r = s.handle(piece(CHAT, eos=True))
    assert set_headers(r.request_body.response)[DEST] in {p["address"] for p in PODS}


@pytest.mark.parametrize("mode", [FULL_DUPLEX, STREAMED])
def test_a_body_over_the_limit_is_a_413_mid_body_and_nothing_is_counted(gw: Gateway, mode: int):
    s = Stream(gw)
    s.handle(headers(mode))
    r = None
    for part in pieces(b'{"model": "m", "prompt": "' + b"x" * 2000, 100):
        r = s.handle(piece(part, eos=False))
        if r is not None and r.HasField("immediate_response"):
            break
    assert r.immediate_response.status.code == 413
    assert json.loads(r.immediate_response.body)["error"]["code"] == "request_too_large"
    assert s.handle(piece(b"more", eos=True)) is None  # Envoy sends nothing it wants answered now
    s.close(cancelled=False)
    assert sum(running(gw).values()) == 0 and len(gw.open) == 0


@pytest.mark.parametrize("mode", [FULL_DUPLEX, STREAMED])
def test_a_client_gone_mid_body_leaves_no_count(gw: Gateway, mode: int):
    s = Stream(gw)
    s.handle(headers(mode))
    s.handle(piece(CHAT[:10], eos=False))
    s.close(cancelled=True)
    assert sum(running(gw).values()) == 0 and len(gw.open) == 0
    assert gw.requests_total.labels("", "", "least-request", "aborted")._value.get() == 1


# -- the endpoint-picker protocol: a pool's data plane (no attributes of ours) ----------------------

def route_of(gw: Gateway, mode: int = FULL_DUPLEX, **kw) -> tuple[Stream, object]:
    s = Stream(gw)
    s.handle(headers(mode, **kw))
    answers = [a for a in feed(s, CHAT) if a is not None]
    return s, answers[0]


def test_the_fallback_list_is_the_pick_then_the_next_best_by_the_same_strategy(gw: Gateway):
    busy = {route_of(gw)[0].decision.pod.address for _ in range(2)}  # least-request: two pods loaded
    assert len(busy) == 2
    s, answer = route_of(gw)
    listed = set_headers(answer.request_headers.response)[DEST].split(",")
    assert len(listed) == 3 and len(set(listed)) == 3  # gateway.fallback_endpoints: 3 by default
    assert listed[0] == s.decision.pod.address
    # by least-request's order: the two idle pods first (the pick, then the other), then a loaded one
    assert listed[0] not in busy and listed[1] not in busy and listed[2] in busy
    assert sum(running(gw).values()) == 3  # the fallbacks are not counted: only each pick is


def test_a_strategy_that_admits_is_asked_for_each_fallback(gw: Gateway):
    """An slo* strategy's policy decides every pick (it may hold a request back), so its fallbacks come
    from asking it again over what is left, not from its picker's one-pass order. A stub policy that
    always takes the highest address shows which: the picker's order would put the tied pods at random."""
    import random

    from extproc.openai import Request
    from extproc.routing.load_math import LowestScorePicker
    from extproc.slo.strategy import SloProfile

    class Highest:
        def pick(self, request, pods, now, queued=False):  # noqa: ANN001, ANN201
            return max(pods, key=lambda v: v.pod.address)

    profile = SloProfile("slo", LowestScorePicker(random.Random(0)), exclusive=True, policy=Highest())
    first = gw.pool.pod_at("10.0.0.4:8000")
    for _ in range(5):
        listed = gw.fallbacks(Request(model="m", path="/v1/chat/completions"), profile, first)
        assert [p.address for p in listed] == ["10.0.0.3:8000", "10.0.0.2:8000"]


def test_the_list_length_follows_the_config(gw: Gateway):
    gw.apply(parse({**CONFIG, "gateway": {**CONFIG["gateway"], "fallback_endpoints": 1}}, {}))
    _, answer = route_of(gw)
    assert "," not in set_headers(answer.request_headers.response)[DEST]


def test_our_bootstrap_gets_the_pick_alone_in_the_metadata_its_route_follows(gw: Gateway):
    s, answer = route_of(gw, ours=True)
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    assert lb == s.decision.pod.address
    assert DEST not in set_headers(answer.request_headers.response)  # the route sets it from the metadata


@pytest.mark.parametrize("subset", [["10.0.0.3:8000"], "10.0.0.3:8000", ["10.0.0.3"],
                                    "10.0.0.9:1,10.0.0.3:8000"])
def test_the_subset_hint_is_honoured(gw: Gateway, subset):
    for _ in range(3):
        s, answer = route_of(gw, subset=subset)
        assert set_headers(answer.request_headers.response)[DEST] == "10.0.0.3:8000"  # no other pod listed


@pytest.mark.parametrize("subset", [[], "", ["10.0.0.9:8000"], ["10.0.0.3:9999"]])
def test_an_empty_or_ineligible_subset_is_a_503(gw: Gateway, subset):
    s, answer = route_of(gw, subset=subset)
    assert answer.immediate_response.status.code == 503
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "no_eligible_endpoint"
    assert sum(running(gw).values()) == 0


def test_a_pool_stream_stays_open_and_ends_the_request_with_its_status(gw: Gateway):
    s, _ = route_of(gw)
    assert not s.finished  # the data plane reports the response on this stream
    assert s.handle(response_headers("200", s.decision.pod.address)).HasField("response_headers")
    s.close(cancelled=False)
    assert len(gw.open) == 0 and sum(running(gw).values()) == 0
    assert gw.requests_total.labels("m", s.decision.pod.name, "least-request", "200")._value.get() == 1


def test_the_served_endpoint_takes_the_count_once(gw: Gateway):
    s, answer = route_of(gw)
    listed = set_headers(answer.request_headers.response)[DEST].split(",")
    first, fallback = s.decision.pod.name, listed[1]
    s.handle(response_headers("200", fallback))  # the first pod refused: the data plane retried
    served = next(p["name"] for p in PODS if p["address"] == fallback)
    assert running(gw)[first] == 0 and running(gw)[served] == 1
    s.handle(response_headers("200", fallback))  # a second report moves nothing twice
    assert running(gw)[served] == 1 and sum(running(gw).values()) == 1
    s.close(cancelled=False)
    assert sum(running(gw).values()) == 0
    assert gw.requests_total.labels("m", served, "least-request", "200")._value.get() == 1


def test_an_unknown_served_endpoint_leaves_the_count_on_the_pick(gw: Gateway):
    s, _ = route_of(gw)
    s.handle(response_headers("200", "10.9.9.9:1"))
    assert running(gw)[s.decision.pod.name] == 1


def test_a_pool_stream_reset_after_the_response_began_ends_the_request_with_its_status(gw: Gateway):
    s, _ = route_of(gw)
    s.handle(response_headers("200"))
    s.close(cancelled=True)  # Envoy may reset the stream at the end instead of closing it
    assert len(gw.open) == 0 and sum(running(gw).values()) == 0
    assert gw.requests_total.labels("m", s.decision.pod.name, "least-request", "200")._value.get() == 1


def test_a_reset_pool_stream_releases_the_count(gw: Gateway):
    s, _ = route_of(gw)
    s.close(cancelled=True)
    assert len(gw.open) == 0 and sum(running(gw).values()) == 0
    assert gw.requests_total.labels("m", s.decision.pod.name, "least-request", "aborted")._value.get() == 1


def test_full_duplex_response_pieces_are_passed_back(gw: Gateway):
    s = Stream(gw)
    first = headers(FULL_DUPLEX)
    first.protocol_config.response_body_mode = FULL_DUPLEX
    s.handle(first)
    feed(s, CHAT)
    r = s.handle(ProcessingRequest(response_body=HttpBody(body=b"data: x\n\n", end_of_stream=False)))
    assert r.response_body.response.body_mutation.streamed_response.body == b"data: x\n\n"


def test_round_robin_fallbacks_follow_the_rotation_without_moving_it():
    gw = Gateway(parse({**CONFIG, "routing": {"default_strategy": "round-robin"}}, {}))
    lists = []
    for _ in range(4):
        s, answer = route_of(gw)
        lists.append(set_headers(answer.request_headers.response)[DEST].split(","))
        s.close(cancelled=True)
    addresses = [p["address"] for p in PODS]
    assert [lst[0] for lst in lists] == addresses  # every pod first once: the rotation went on as before
    for lst in lists:  # each list: the pick, then the pods after it in the rotation
        i = addresses.index(lst[0])
        assert lst == [addresses[(i + k) % 4] for k in range(3)]


def test_our_bootstrap_full_duplex_is_one_answer_with_the_body_and_the_route(gw: Gateway):
    """Without a headers message (the headers come as attributes with the first piece), the whole body
    goes back in one streamed piece carrying the route's metadata: ORIGINAL_DST reads it at the router."""
    s = Stream(gw)
    first = piece(CHAT[:10], eos=False)
    first.protocol_config.request_body_mode = FULL_DUPLEX
    first.attributes[FILTER].fields["request.path"].string_value = "/v1/chat/completions"
    first.attributes[FILTER].fields["request.method"].string_value = "POST"
    assert s.handle(first) is None
    assert s.handle(piece(CHAT[10:], eos=False)) is None
    answer = s.handle(piece(b"", eos=True))
    streamed = answer.request_body.response.body_mutation.streamed_response
    assert streamed.body == CHAT and streamed.end_of_stream
    assert answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value == \
        s.decision.pod.address
    assert s.finished and sum(running(gw).values()) == 1


@settings(max_examples=300, deadline=None)
@given(mode=st.sampled_from([FULL_DUPLEX, STREAMED, BUFFERED, BUFFERED_PARTIAL]), ours=st.booleans(),
       size=st.integers(1, 60), big=st.booleans(), trailers=st.booleans(), cut=st.integers(0, 8),
       served=st.sampled_from([None, 0, 1, 9]), status=st.sampled_from([None, "200", "503"]),
       cancelled=st.booleans())
def test_counts_balance_on_every_path(mode, ours, size, big, trailers, cut, served, status, cancelled):
    """Any body mode, attachment, piece size, trailers or not, a body over the limit, a client gone
    after any message, a served endpoint reported or not, a stream that ends or is reset: once the
    request is over (its stream closed, and for our bootstrap its access-log record in), nothing is
    left counted and nothing was released twice."""
    gw = Gateway(parse(CONFIG, {}))
    data = json.dumps({"model": "m", "prompt": "x" * (2000 if big else 10)}).encode()
    messages = [headers(mode, ours=ours)]
    parts = pieces(data, size)
    messages += [piece(p, eos=not trailers and i == len(parts) - 1) for i, p in enumerate(parts)]
    if trailers:
        messages.append(ProcessingRequest(request_trailers=HttpTrailers()))
    if status is not None:
        messages.append(response_headers(status, PODS[served]["address"] if served in (0, 1) else
                                         "10.9.9.9:1" if served == 9 else None))
    s = Stream(gw)
    for msg in messages[:len(messages) - cut if cut < len(messages) else 1]:
        s.handle(msg)
        if s.finished:
            break
    s.close(cancelled)
    if s.decision is not None:  # our bootstrap: the access-log record comes, maybe after a reset
        gw.complete(s.decision.key, RequestEnd(200))
        gw.complete(s.decision.key, RequestEnd(200))  # twice: the second finds nothing
    assert all(n == 0 for n in running(gw).values()) and len(gw.open) == 0


def test_a_request_held_back_keeps_its_subset_when_it_leaves_the_waiting_room(gw: Gateway):
    """The subset hint travels with the request (Request.endpoint_subset), so a strategy's waiting
    room routes it by the hint too when it lets it go."""
    from extproc.openai import Request

    request = Request(model="m", path="/v1/chat/completions", endpoint_subset=frozenset({"10.0.0.4:8000"}))
    profile = gw.profile(None, "m")
    for _ in range(3):
        routed = gw.route(request, profile, "rid", queued=True)
        assert routed.pod.address == "10.0.0.4:8000"
    assert gw.route(Request(model="m", path="/v1/chat/completions", endpoint_subset=frozenset()),
                    profile, "rid") is None  # an empty hint: nothing is eligible

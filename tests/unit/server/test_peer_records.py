"""Two gateway processes behind one Envoy: Envoy's access-log stream goes to one of them, so records
of the other's requests arrive at the wrong gateway. They are passed on (through Redis; here an
in-memory stand-in) and the routing gateway releases its count; the tokens are credited once."""

from __future__ import annotations

from extproc.config import parse
from extproc.openai import Request
from extproc.server.gateway import Gateway
from extproc.sharing.shared import LocalState
from extproc.state.accounting import Accounting
from extproc.vocabulary import RequestEnd

RAW = {"models": {"m": {"pods": [{"name": "a", "address": "10.0.0.1:8000"}]}}}


class Mailboxes:
    def __init__(self) -> None:
        self.boxes: dict[str, list[tuple[str, int]]] = {}


class ForwardingState(LocalState):
    """LocalState with the forwarding face of RedisState (listen / forward / take_forwarded)."""

    def __init__(self, hub: Mailboxes) -> None:
        super().__init__()
        self.hub, self.origin = hub, ""

    def listen(self, origin: str) -> None:
        self.origin = origin
        self.hub.boxes.setdefault(origin, [])

    def forward(self, owner: str, key: str, status: int) -> bool:
        self.hub.boxes.setdefault(owner, []).append((key, status))
        return True

    def take_forwarded(self) -> list[tuple[str, int]]:
        out, self.hub.boxes[self.origin] = self.hub.boxes[self.origin], []
        return out


def gateway(hub: Mailboxes) -> Gateway:
    return Gateway(parse(RAW, env={}), accounting=Accounting(ForwardingState(hub)))


def test_a_record_received_by_the_other_gateway_releases_the_routing_gateways_count():
    hub = Mailboxes()
    a, b = gateway(hub), gateway(hub)
    assert a.origin != b.origin
    decisions = [a.route(Request("m", "/v1/chat/completions", stream=True), a.profile("least-request", "m"),
                         f"r{i}") for i in range(3)]
    pod = decisions[0].pod
    for d in decisions:  # Envoy's log stream goes to b
        b.complete(d.key, RequestEnd(200, output_tokens=10, upstream=pod.address))
    assert a.accounting.shared.running(pod.key) == 3  # not yet passed on
    assert a.release_forwarded() == 3
    assert a.accounting.shared.running(pod.key) == 0 and len(a.open) == 0
    assert b.accounting.output_tokens[pod.key] == 30 and a.accounting.output_tokens.get(pod.key, 0) == 0
    assert a.requests_total.labels("m", "a", "least-request", "200")._value.get() == 3
    assert b.peer_records.labels("sent")._value.get() == 3
    assert a.release_forwarded() == 0  # each once


def test_own_late_records_are_not_forwarded():
    hub = Mailboxes()
    a = gateway(hub)
    d = a.route(Request("m", "/v1/chat/completions"), a.profile("least-request", "m"), "r")
    a.complete(d.key, RequestEnd(200, output_tokens=4, upstream=d.pod.address))
    a.complete(d.key, RequestEnd(200, output_tokens=4, upstream=d.pod.address))  # a duplicate: unmatched
    assert hub.boxes[a.origin] == [] and a.peer_records.labels("sent")._value.get() == 0


def test_without_redis_nothing_is_forwarded():
    a, b = Gateway(parse(RAW, env={})), Gateway(parse(RAW, env={}))
    d = a.route(Request("m", "/v1/chat/completions"), a.profile("least-request", "m"), "r")
    b.complete(d.key, RequestEnd(200, output_tokens=4, upstream=d.pod.address))
    assert a.release_forwarded() == 0 and b.accounting.output_tokens[d.pod.key] == 4

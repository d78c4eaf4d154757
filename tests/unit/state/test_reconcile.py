"""In-flight counts reconciled against the engines' own (a lost access-log stream's requests)."""

from __future__ import annotations

from extproc.config import parse
from extproc.openai import Request
from extproc.server.gateway import Gateway
from extproc.sharing.shared import LocalState
from extproc.state.accounting import Accounting
from extproc.state.reconcile import Reconciler
from extproc.telemetry.engine_metrics import EngineSample
from extproc.telemetry.health import PodHealth
from extproc.vocabulary import RequestEnd


def sample(running: float, at: float, waiting: float = 0.0, sent: float | None = None) -> EngineSample:
    return EngineSample(running=running, waiting=waiting, kv_usage=None, cpu_kv_usage=None, at=at, sent=sent)


def test_phantoms_on_an_idle_engine_are_released_after_three_scrapes():
    r = Reconciler(scrapes=3)
    assert r.excess("p", 10, 0, sample(0, 1.0)) == 0
    assert r.excess("p", 10, 0, sample(0, 1.0)) == 0  # the same scrape again is no new evidence
    assert r.excess("p", 10, 0, sample(0, 2.0)) == 0
    assert r.excess("p", 10, 0, sample(0, 3.0)) == 10


def test_the_smallest_excess_of_the_run_is_released():
    r = Reconciler(scrapes=3)
    for at, running in ((1.0, 0), (2.0, 4), (3.0, 1)):
        n = r.excess("p", 10, 0, sample(running, at))
    assert n == 6


def test_a_record_on_its_way_is_not_a_phantom():
    # 20 counted, the engine holds 19 on a few scrapes: a request finished and its record is in
    # flight (records come within milliseconds, so not on every scrape).
    r = Reconciler(scrapes=3, patience=5)
    assert all(r.excess("p", 20, 0, sample(19 if t % 5 else 20, t)) == 0 for t in range(1, 30))


def test_a_small_excess_that_never_goes_is_released_after_the_patience():
    # Below the tolerance (2) on a busy engine, but on every scrape: a phantom.
    r = Reconciler(scrapes=3, patience=5)
    assert [r.excess("p", 20, 0, sample(19, t)) for t in range(1, 7)] == [0, 0, 0, 0, 1, 0]


def test_a_scrape_that_agrees_starts_the_run_again():
    r = Reconciler(scrapes=3)
    r.excess("p", 5, 0, sample(0, 1.0))
    r.excess("p", 5, 0, sample(0, 2.0))
    assert r.excess("p", 5, 0, sample(5, 3.0)) == 0
    assert r.excess("p", 5, 0, sample(0, 4.0)) == 0
    assert r.excess("p", 5, 0, sample(0, 5.0)) == 0
    assert r.excess("p", 5, 0, sample(0, 6.0)) == 5


def test_a_pod_no_longer_suspect_starts_the_run_again():
    r = Reconciler(scrapes=3)
    assert r.suspect("p", 5, sample(0, 1.0))
    r.excess("p", 5, 0, sample(0, 1.0))
    r.excess("p", 5, 0, sample(0, 2.0))
    assert not r.suspect("p", 5, sample(5, 3.0))  # the engine caught up: the earlier scrapes are void
    assert not r.suspect("p", 5, None)  # no engine count is no evidence either way
    assert r.excess("p", 5, 0, sample(0, 4.0)) == 0
    assert r.excess("p", 5, 0, sample(0, 5.0)) == 0
    assert r.excess("p", 5, 0, sample(0, 6.0)) == 5


def test_other_gateways_requests_are_never_released():
    # The engine idle; other gateways hold 6 of the 16 counted: all ten of ours are phantoms.
    r = Reconciler(scrapes=1)
    assert r.excess("p", 10, 6, sample(0, 1.0)) == 10
    # The engine holds 6: ours, or the others' (they may hold phantoms too). Our share of the 10.
    assert r.excess("p", 10, 6, sample(6, 2.0)) == 6
    # Nothing of ours left to release: the engine holding fewer than the others releases nothing.
    assert r.excess("p", 0, 6, sample(2, 3.0)) == 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gateway_with_samples() -> tuple[Gateway, Clock, dict]:
    latest: dict = {}
    clock = Clock()
    accounting = Accounting(LocalState(), health=PodHealth(), samples=lambda key, now: latest.get(key))
    raw = {"models": {"m": {"pods": [{"name": "a", "address": "10.0.0.1:8000"}]}}}
    return Gateway(parse(raw, env={}), clock=clock, accounting=accounting), clock, latest


def test_the_gateway_releases_what_the_engine_no_longer_holds_and_credits_a_late_record_once():
    gw, clock, latest = gateway_with_samples()
    profile = gw.profile("least-request", "m")
    decisions = [gw.route(Request("m", "/v1/chat/completions", stream=True), profile, f"r{i}")
                 for i in range(10)]
    pod = decisions[0].pod
    clock.now += 5.0  # Envoy was killed with the ten streams open: their records never come
    for _ in range(4):  # each scrape is judged at the next, once records on their way are in
        gw.reconcile(pod.key, sample(0, clock.now))
        clock.now += 1.0
    assert gw.accounting.shared.running(pod.key) == 0
    assert len(gw.open) == 0
    assert gw.released_requests.labels("engine_count")._value.get() == 10
    # A record that does arrive late finds nothing open: its tokens are credited, once, no decrement.
    gw.complete(decisions[0].key, RequestEnd(200, output_tokens=7, upstream=pod.address))
    assert gw.accounting.output_tokens[pod.key] == 7
    assert gw.accounting.shared.running(pod.key) == 0


def test_requests_routed_after_the_scrape_are_not_released():
    gw, clock, latest = gateway_with_samples()
    profile = gw.profile("least-request", "m")
    for i in range(3):  # routed 1 s before each scrape: not yet on the engine when it was read
        clock.now += 1.0
        gw.route(Request("m", "/v1/chat/completions", stream=True), profile, f"r{i}")
        gw.reconcile(gw.pool.all_pods()[0].key, sample(0, clock.now + 0.5, sent=clock.now - 0.01))
    assert len(gw.open) == 3


class PeerState(LocalState):
    """LocalState plus what Redis says other gateways hold on each pod."""

    def __init__(self, others: int) -> None:
        super().__init__()
        self.others = others

    def running(self, key) -> int:
        return super().running(key) + self.others


def test_the_count_never_drops_below_what_other_gateways_hold():
    latest: dict = {}
    clock = Clock()
    shared = PeerState(others=6)
    accounting = Accounting(shared, health=PodHealth(), samples=lambda key, now: latest.get(key))
    raw = {"models": {"m": {"pods": [{"name": "a", "address": "10.0.0.1:8000"}]}}}
    gw = Gateway(parse(raw, env={}), clock=clock, accounting=accounting)
    profile = gw.profile("least-request", "m")
    for i in range(10):
        gw.route(Request("m", "/v1/chat/completions", stream=True), profile, f"r{i}")
    key = gw.pool.all_pods()[0].key
    clock.now += 5.0
    for _ in range(16):  # the engine holds only the other gateways' six: all ten of ours are lost,
        gw.reconcile(key, sample(6, clock.now))  # released a share at a time (6, 2, 1, 1)
        clock.now += 1.0
    # the last one is within the tolerance of a busy engine (2): the count is true to one request
    assert shared.local_running(key) <= 1 and shared.running(key) <= 7
    for _ in range(4):  # nothing of ours left: the engine holding fewer still releases nothing
        gw.reconcile(key, sample(0, clock.now))
        clock.now += 1.0
    assert shared.running(key) == 6
    assert gw.released_requests.labels("engine_count")._value.get() == 10


def test_the_grace_covers_the_scrape_timeout():
    # A sample that does not know when it was sent: a request routed 1.5 s before the scrape
    # returned (default timeout 0.5 s) is in the engine's count.
    gw, _, _ = gateway_with_samples()
    assert gw.reconciler.grace_s == 1.5
    raw = {"models": {"m": {"pods": [{"name": "a", "address": "10.0.0.1:8000"}]}},
           "telemetry": {"timeout_seconds": 4}}
    gw.apply(parse(raw, env={}))
    assert gw.reconciler.grace_s == 5.0


def test_under_continuing_load_requests_routed_just_before_the_scrape_do_not_hide_phantoms():
    """The issue's case: 20 phantoms (Envoy killed), then 20 clients streaming short answers through
    the new Envoy, so that at every scrape most real requests are younger than a second. All 20
    phantoms are released by the third scrape; none of the real requests."""
    gw, clock, _ = gateway_with_samples()
    profile = gw.profile("least-request", "m")
    route = lambda i: gw.route(Request("m", "/v1/chat/completions", stream=True), profile, f"r{i}")  # noqa: E731
    for i in range(20):
        route(i)
    key = gw.pool.all_pods()[0].key
    real: list[str] = []
    n = 20
    for scrape in range(4):
        clock.now += 1.0
        for k in real:  # last second's requests finished: their records came
            gw.complete(k, RequestEnd(200, output_tokens=5, upstream="10.0.0.1:8000"))
        real = []
        for _ in range(20):  # each client's next request, routed over the last 0.4 s
            clock.now += 0.02
            real.append(route(n).key)
            n += 1
        clock.now += 0.005
        sent = clock.now
        clock.now += 0.005
        released = gw.reconcile(key, sample(20, clock.now, sent=sent))  # the engine holds the 20 real
        assert released == (20 if scrape == 3 else 0)  # the third scrape, judged at the fourth
    assert gw.accounting.shared.running(key) == 20
    assert {o.request_id for o in gw.open} == {f"r{i}" for i in range(80, 100)}


def test_two_gateways_each_release_their_share_of_the_excess():
    # Both gateways routed through the Envoy that died: each holds 10 phantoms and 10 real
    # requests; the engine holds the 20 real. Each sees an excess of 20, and releases its half.
    r = Reconciler(scrapes=1)
    assert r.excess("p", 20, 20, sample(20, 1.0, sent=0.99)) == 10
    # One gateway holds all 20 phantoms and 10 real, the other 10 real: 15 and 5 of the 20,
    # never more than the pod's excess in all.
    a, b = Reconciler(scrapes=1), Reconciler(scrapes=1)
    assert a.excess("p", 30, 10, sample(20, 1.0)) == 15
    assert b.excess("p", 10, 30, sample(20, 1.0)) <= 5


def test_short_requests_whose_records_come_after_the_scrape_are_not_phantoms():
    """Requests of a few milliseconds end before the scrape reads the engine; their records come tens
    of milliseconds later. Judged at the next scrape, with the records in, they are no excess."""
    gw, clock, _ = gateway_with_samples()
    profile = gw.profile("least-request", "m")
    key = gw.pool.all_pods()[0].key
    for scrape in range(10):
        keys = [gw.route(Request("m", "/v1/chat/completions"), profile, f"r{scrape}.{i}").key
                for i in range(3)]
        clock.now += 0.01
        sent = clock.now
        clock.now += 0.002
        gw.reconcile(key, sample(0, clock.now, sent=sent))  # the engine idle: all three had ended
        clock.now += 0.03
        for k in keys:
            gw.complete(k, RequestEnd(200, output_tokens=4, e2e_s=0.005, upstream="10.0.0.1:8000"))
        clock.now += 0.5
    assert gw.released_requests.labels("engine_count")._value.get() == 0
    assert gw.accounting.shared.running(key) == 0

"""The GPU optimizer in the fleet simulation's loop: it reads the gateways' traces, its plan scales each
deployment after the provisioning delay, min_replicas holds only without load (the spec), a step in load
does not make it flap, and `strategy@deployment` runs one deployment only (the spec's Scalar)."""

from __future__ import annotations

import math

import pytest

from extproc.fleetsim.arrivals import generate
from extproc.fleetsim.autoscale import Timeline, direction_changes, mean_cost, turns_while_loaded
from extproc.fleetsim.fleet import build_replicas
from extproc.fleetsim.loop import REJECTED, run
from extproc.fleetsim.metrics import summarize
from extproc.gpu_profiles import parse_profile
from extproc.optimizer.policy import PlanPolicy
from tests.unit.fleetsim.conftest import small

CHAT = {"name": "chat", "rate": 2, "prompt": {"mean": 200, "sigma": 0.5, "max": 1000},
        "output": {"mean": 40, "sigma": 0.5, "max": 200}}


def flat(name: str, tput: float, cost: float):
    """A profile whose pod serves `tput` req/s of every shape within the SLO."""
    return parse_profile({"gpu": name, "cost": cost, "tputs": [[tput] * 2] * 2,
                          "indexes": [[16, 1024], [128, 4096]], "e2e": [[1.0] * 2] * 2,
                          "slos": {"percentile": 99, "tpot": 0.05}, "created": 1.0})


def scenario(**overrides):
    raw = {"duration_s": 400, "warmup_s": 100, "streams": [CHAT],
           "fleet": [{"gpu": "A100", "replicas": 10, "initial": 2, "min_replicas": 2, "cost": 2.0,
                      "name": "fast"},
                     {"gpu": "L20", "replicas": 10, "initial": 1, "min_replicas": 1, "cost": 1.0,
                      "name": "slow"}],
           # the load triples at 200 s (a step), and stays
           "events": [{"kind": "rate", "at": 200, "until": 400, "factor": 3}],
           # headroom 0: these tests follow the autoscaler's mechanics on plain loads
           "autoscale": {"provision_s": 30, "interval_s": 10, "window_s": 60, "headroom": 0}}
    raw.update(overrides)
    return small(**raw)


PROFILES = {"fast": flat("fast", 1.0, 2.0), "slow": flat("slow", 0.5, 3.0)}  # slow: 6.0 per req/s, fast 2.0


def test_the_plan_scales_the_cheaper_type_after_a_step_and_settles():
    sc = scenario()
    res = run(sc, "least-request", generate(sc, 5), seed=5, optimizer=True, gpu_profiles=PROFILES)
    tl = res.autoscale
    at = {t: k for k, t in enumerate(tl.times)}
    # before the step: ~2 req/s on the cheaper-per-request type (fast); slow, not needed, goes to 0 under
    # load once the scale-down stabilization (300 s) has let go of the initial fleet (min_replicas applies
    # only when there is no workload; the PodAutoscalers' floor is 0)
    assert 2 <= tl.desired["fast"][at[190.0]] <= 4 and tl.desired["slow"][at[390.0]] == 0
    # after it: ~6 req/s needs ~6 fast pods, asked for within one window, serving one provisioning later
    assert tl.desired["fast"][at[260.0]] >= 5
    ready = [t for t, n in zip(tl.times, tl.billed["fast"]) if n >= 5]
    assert ready and ready[0] >= 200
    started = sum(1 for spans in res.spans.values() if any(s[0] > 200 for s in spans))
    assert started >= 3  # replicas that began serving after the step
    assert min(tl.billed["fast"]) >= 2
    for d in ("fast", "slow"):  # no flapping on a step
        assert direction_changes(tl.desired[d], tl.times, 300.0) <= 1
    summary = summarize(res)["autoscale"]
    assert summary["cost_per_hour_end"] == pytest.approx(
        tl.billed["fast"][-1] * 2.0 + tl.billed["slow"][-1] * 1.0)
    # the mean is the bill's integral, not the re-plans' samples
    assert summary["cost_per_hour_mean"] == pytest.approx(mean_cost(tl.bills, sc.warmup_s, sc.duration_s))


def test_a_draining_replica_is_billed_until_its_last_request_ends():
    # 8 L20 at 3 req/s of 400-token answers (45 in flight), planned at 1 req/s a replica: the plan wants
    # about 3 once the stabilization (300 s) lets go of the initial fleet; those removed with requests in
    # flight drain, each billed until it is empty
    answers = {**CHAT, "rate": 3, "output": {"mean": 400, "sigma": 0.3, "max": 1000}}
    sc = scenario(fleet=[{"gpu": "L20", "replicas": 8, "initial": 8, "cost": 1.0, "name": "l20"}],
                  duration_s=420, events=[], streams=[answers])
    res = run(sc, "least-request", generate(sc, 2), seed=2, optimizer=True,
              gpu_profiles={"l20": flat("l20", 1.0, 1.0)})
    tl = res.autoscale
    replans = set(tl.times)
    drains = [(before, cost) for (_, before), (t, cost) in zip(tl.bills, tl.bills[1:]) if t not in replans]
    assert drains and all(cost == before - 1.0 for before, cost in drains)  # one replica at a time
    sampled = [c for t, c in zip(tl.times, tl.cost_per_hour) if sc.warmup_s <= t < sc.duration_s]
    assert mean_cost(tl.bills, sc.warmup_s, sc.duration_s) < sum(sampled) / len(sampled)


def test_the_mean_cost_integrates_the_bill_over_the_window():
    bills = [(0.0, 10.0), (100.0, 4.0), (105.0, 2.0), (300.0, 6.0)]
    assert mean_cost(bills, 100.0, 200.0) == pytest.approx((5 * 4.0 + 95 * 2.0) / 100)
    assert mean_cost(bills, 50.0, 400.0) == pytest.approx((50 * 10 + 5 * 4 + 195 * 2 + 100 * 6) / 350)
    assert mean_cost(bills, 200.0, 200.0) == 0.0 and mean_cost([(10.0, 3.0)], 0.0, 20.0) == pytest.approx(1.5)


def test_the_routers_refusals_reach_the_optimizers_traces():
    # at most one replica of each, 15 req/s tripled at 200 s: the SLO router refuses what cannot wait,
    # and the optimizer reads those refusals in the traces (meta_rejected). The profiles reach the router
    # too (--profiles): these admit ~15 req/s of this chat on the two replicas, not three times that
    sc = scenario(fleet=[{"gpu": "A100", "replicas": 1, "initial": 1, "cost": 2.0, "name": "fast"},
                         {"gpu": "L20", "replicas": 1, "initial": 1, "cost": 1.0, "name": "slow"}],
                  duration_s=300, streams=[{**CHAT, "rate": 15}])
    profiles = {"fast": flat("fast", 10.0, 2.0), "slow": flat("slow", 5.0, 1.0)}
    res = run(sc, "slo", generate(sc, 6), seed=6, optimizer=True, gpu_profiles=profiles)
    refused = sum(1 for s in res.status if s == REJECTED)
    assert refused > 0
    tl = res.autoscale
    assert max(tl.refused) > 0
    assert all(n == 0 for t, n in zip(tl.times, tl.refused) if t <= 100)  # none before any was refused


def test_the_traces_carry_the_gateways_queue_and_in_flight_requests(monkeypatch):
    # meta_pending_reqs / meta_queueing_reqs, as a live gateway writes them: its requests in flight and
    # those its SLO router holds back. One replica of each, 15 req/s tripled at 200 s: it queues some.
    import extproc.fleetsim.autoscale as autoscale

    read: list = []
    parse = autoscale.parse_trace

    def spy(end, data):
        read.append(window := parse(end, data))
        return window

    monkeypatch.setattr(autoscale, "parse_trace", spy)
    sc = scenario(fleet=[{"gpu": "A100", "replicas": 1, "initial": 1, "cost": 2.0, "name": "fast"},
                         {"gpu": "L20", "replicas": 1, "initial": 1, "cost": 1.0, "name": "slow"}],
                  duration_s=300, streams=[{**CHAT, "rate": 15}])
    profiles = {"fast": flat("fast", 10.0, 2.0), "slow": flat("slow", 5.0, 1.0)}
    run(sc, "slo", generate(sc, 6), seed=6, optimizer=True, gpu_profiles=profiles)
    assert max(w.queueing for w in read) > 0
    assert max(w.pending for w in read) > 0


def test_same_seed_same_scaling():
    sc = scenario(duration_s=260)
    a = run(sc, "least-request", generate(sc, 2), seed=2, optimizer=True, gpu_profiles=PROFILES).autoscale
    b = run(sc, "least-request", generate(sc, 2), seed=2, optimizer=True, gpu_profiles=PROFILES).autoscale
    assert a.desired == b.desired and a.billed == b.billed


def test_a_stream_switched_off_scales_down_within_the_window():
    sc = scenario(events=[{"kind": "rate", "at": 200, "until": 400, "factor": 0, "stream": "chat"}],
                  streams=[CHAT, {**CHAT, "name": "other", "rate": 1}],
                  autoscale={"provision_s": 30, "interval_s": 10, "window_s": 60, "stabilization_s": 30,
                             "headroom": 0})
    res = run(sc, "least-request", generate(sc, 3), seed=3, optimizer=True, gpu_profiles=PROFILES)
    tl = res.autoscale
    at = {t: k for k, t in enumerate(tl.times)}
    assert tl.desired["fast"][at[190.0]] >= 3        # 3 req/s
    assert tl.desired["fast"][at[200.0 + 60 + 30 + 10]] <= 2  # 1 req/s: the window and stabilization passed
    assert not any(a.stream == 0 and a.time >= 200 for a in res.arrivals)




def test_min_replicas_holds_without_load_only():
    import json

    from extproc.fleetsim.autoscale import EPOCH, Optimizer
    from extproc.fleetsim.scenario import Autoscale, Group
    from extproc.tracing.window import trace_key

    groups = {"fast": Group("A100", 10, "fast", initial=2, min_replicas=2, cost=2.0),
              "slow": Group("L20", 10, "slow", initial=1, min_replicas=1, cost=3.0)}
    opt = Optimizer("m", groups, PROFILES, Autoscale(provision_s=0, interval_s=10, window_s=10,
                                                     stabilization_s=0,
                                                     policy=PlanPolicy(headroom=0)), lambda: 0.0)

    def asked(t: float, rps: float) -> dict[str, int]:
        n = round(rps * 10)
        opt.redis[trace_key("m", int(EPOCH + t))] = json.dumps(
            {"70:30": n, "meta_v": 4, "meta_interval_sec": 10, "meta_precision": 10, "meta_total_reqs": n})
        return opt.tick(t)

    # under load the plan needs no slow pod and one fast one: the autoscalers' floor is 0, as the spec
    # requires, so min_replicas does not hold them up
    assert asked(10, 1.0) == {"fast": 1, "slow": 0}
    # no workload: each deployment keeps its min_replicas
    assert asked(20, 0.0) == {"fast": 2, "slow": 1}

def test_scalar_runs_one_deployment_only():
    sc = scenario(duration_s=150)
    res = run(sc, "least-request@slow", generate(sc, 1), seed=1, optimizer=True, gpu_profiles=PROFILES)
    served = {res.replicas[i].deployment for i in res.replica_of if i >= 0}
    assert served == {"slow"} and set(res.autoscale.desired) == {"slow"}
    with pytest.raises(ValueError, match="no deployment named"):
        run(sc, "least-request@nope", generate(sc, 1), seed=1, optimizer=True, gpu_profiles=PROFILES)


def test_direction_changes_counts_turns_within_a_span():
    times = [float(t) for t in range(0, 100, 10)]
    assert direction_changes([1, 2, 3, 3, 3, 3, 3, 3, 3, 3], times, 300) == 0
    assert direction_changes([1, 2, 1, 2, 1, 2, 2, 2, 2, 2], times, 300) == 4
    assert direction_changes([1, 2, 1, 2, 1, 2, 2, 2, 2, 2], times, 15) == 2  # turns 10 s apart


def test_turns_are_counted_while_the_scenario_sends_requests_not_in_its_drain():
    """A count that comes down at the load's fall and goes up once arrivals have stopped (the trace then
    holds only the slowest requests' completions) turned once while loaded; the start-up counts."""
    times = [float(t) for t in range(0, 200, 10)]
    a10 = [6, 9, 16, 16, 16, 16, 16, 16, 16, 16, 14, 12, 10, 8, 6, 4, 2, 2, 3, 3]  # up, down; up at 180 s
    l20 = [12, 4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6]  # down, up: both at start-up
    tl = Timeline(times=times, desired={"a10": a10, "l20": l20})
    assert direction_changes(a10, times, 300.0) == 2  # the whole series, drain included
    assert turns_while_loaded(tl, 180.0) == {"a10": 1, "l20": 1}
    assert turns_while_loaded(tl, 200.0) == {"a10": 2, "l20": 1}


def test_the_loop_hands_the_optimizers_cuts_to_every_gateways_slo_router(monkeypatch):
    """As live gateways read them from Redis (slo/fleet_factors.py): after each re-plan, each gateway's SLO
    state gets the feedback's cuts, and only cuts."""
    from extproc.optimizer.feedback import Feedback
    from extproc.slo.state import SloState

    def update(self, windows, now, profiles, grew=None):  # noqa: ANN001, ANN202
        self.factors.update({"slow": 0.5, "fast": 1.2})

    handed: list[tuple[str, dict]] = []
    set_cuts = SloState.set_cuts

    def recorded(self, model, cuts):  # noqa: ANN001, ANN202
        handed.append((model, dict(cuts)))
        set_cuts(self, model, cuts)

    monkeypatch.setattr(Feedback, "update", update)
    monkeypatch.setattr(SloState, "set_cuts", recorded)
    sc = scenario(duration_s=60, warmup_s=10, events=[])
    run(sc, "slo", generate(sc, 1), seed=1, gateways=2, optimizer=True, gpu_profiles=PROFILES)
    assert len(handed) >= 2 * 5  # two gateways, every 10 s re-plan
    assert {model for model, _ in handed} == {sc.model}
    assert all(cuts == {"slow": 0.5} for _, cuts in handed)


def test_a_lost_replica_can_be_provisioned_again_and_serves():
    sc = scenario(duration_s=300, events=[
        {"kind": "lose-replicas", "at": 50, "gpu": "A100", "fraction": 1.0},
        {"kind": "rate", "at": 100, "until": 300, "factor": 3}])
    res = run(sc, "least-request", generate(sc, 4), seed=4, optimizer=True, gpu_profiles=PROFILES)
    fast = [r for r in res.replicas if r.deployment == "fast"]
    back = [r for r in fast if r.index in res.lost_at and len(res.spans[r.index]) > 1]
    assert back, "a lost replica was asked for again"
    again = {r.index for r in back}
    late = [i for i, a in enumerate(res.arrivals) if a.time > 200 and res.replica_of[i] in again]
    assert late and all(res.status[i] == 1 for i in late)  # its requests complete: its engine steps


def test_a_provisioned_replica_steps_on_its_first_request_whatever_its_past():
    from extproc.fleetsim.autoscale import FleetScaler

    class Clock:
        now = 70.0

        def __call__(self) -> float:
            return self.now

    r = build_replicas(scenario(), 0)[0]
    r.alive, r.scheduled = False, 52.3  # lost mid-step: that step event was skipped
    spans: dict = {r.index: [[0.0, 50.0]]}
    woken: list = []
    scaler = FleetScaler(None, [r], spans, Clock(), lambda t, i: woken.append((t, i)), lambda: None)  # type: ignore[arg-type]
    scaler.ready_at[r.index] = 70.0
    r.starting = True
    scaler.provisioned(r)
    assert r.alive and r.ready and not r.starting and spans[r.index][-1] == [70.0, math.inf]
    assert r.scheduled < 0  # else the loop would wait for a step that never comes


def test_the_autoscaler_holds_within_its_tolerance():
    import json

    from extproc.fleetsim.autoscale import EPOCH, Optimizer
    from extproc.fleetsim.scenario import Autoscale, Group
    from extproc.tracing.window import trace_key

    group = Group("A100", 100, "fast", initial=1, min_replicas=1, cost=1.0)
    opt = Optimizer("m", {"fast": group}, {"fast": flat("fast", 1.0, 1.0)},
                    Autoscale(provision_s=0, interval_s=10, window_s=10, stabilization_s=0,
                              policy=PlanPolicy(headroom=0)),
                    lambda: 0.0)

    def asked(t: float, rps: float) -> int:
        n = round(rps * 10)
        end = int(EPOCH + t)
        opt.redis[trace_key("m", end)] = json.dumps({"70:30": n, "meta_v": 4, "meta_interval_sec": 10,
                                                     "meta_precision": 10, "meta_total_reqs": n})
        return opt.tick(t)["fast"]

    assert asked(10, 20) == 20
    assert asked(20, 21.5) == 20   # 22 is within 10 % of 20: it stays
    assert asked(30, 18.5) == 20   # and 19
    assert asked(40, 25) == 25     # beyond it: it scales
    assert asked(50, 12) == 12


def test_given_profiles_reach_the_slo_router_and_the_plan_alike():
    # fleet-sim --profiles DIR: the router's SLO state and the optimizer plan from the same profiles,
    # none measured on the engine model (a deployment without one would be)
    from extproc.fleetsim.loop import FleetRun
    from extproc.slo.state import learned

    sc = scenario(duration_s=30, warmup_s=10)
    fleet = FleetRun(sc, "slo", generate(sc, 1), seed=1, optimizer=True, gpu_profiles=PROFILES)
    state = learned(fleet.gws[0].gateway.router.state.store)
    assert state is not None
    routed = {d: m.profile for d, m in state.table(sc.model).items()}
    assert routed == PROFILES
    assert fleet.scaler is not None
    assert fleet.scaler.optimizer.profiles == [PROFILES[d] for d in sorted(PROFILES)]

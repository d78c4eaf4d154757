"""The plan's correction from what it produced: per deployment TPOT histograms in the traces (meta_tpot)
move a factor on that deployment's profile down on missed SLOs and back up with headroom; AIBrix's
trace reader still reads the windows (it skips meta_ keys)."""

from __future__ import annotations

import json

import pytest

from extproc.gpu_profiles import parse_profile
from extproc.optimizer.feedback import Feedback, outcome, scaled, strained
from extproc.optimizer.planning import PlanSettings, replan
from extproc.optimizer.workload import WorkloadError, parse_trace
from extproc.tracing.window import TPOT_KEY, TraceRecorder, tpot_bucket, tpot_of_bucket

EPOCH = 1_700_000_000


def profile(name: str, tput: float, cost: float, tpot: float = 0.05):
    return parse_profile({"gpu": name, "cost": cost, "tputs": [[tput] * 2] * 2,
                          "indexes": [[16, 1024], [128, 4096]], "e2e": [[1.0] * 2] * 2,
                          "slos": {"percentile": 99, "tpot": tpot}, "created": 1.0})


def windows(per_window: dict[str, list[float]], start: int, count: int, rps: int = 10):
    """`count` 10 s windows from `start`, each with `rps` x 10 chat completions spread over the
    deployments, with the given TPOTs (cycled) per deployment."""
    rec = TraceRecorder()
    out = []
    for k in range(count):
        t = start + 10 * k + 5
        for dep, tpots in per_window.items():
            for j in range(rps * 10 // len(per_window)):
                rec.completed("m", 200, 100, t, dep, tpots[j % len(tpots)])
            rec.arrived("m", t)
        for key, raw in rec.due(t + 10):
            out.append(parse_trace(int(key.rsplit("_", 1)[1]), json.loads(raw)))
    return out


def shaped_windows(per_window: dict[tuple[int, int], int], count: int = 24) -> list:
    """`count` 10 s windows from EPOCH, each with the given completions per (input, output) tokens, all
    on deployment a10 at 20 ms a token."""
    rec = TraceRecorder()
    out = []
    for k in range(count):
        t = EPOCH + 10 * k + 5
        for (prompt, output), n in per_window.items():
            for _ in range(n):
                rec.completed("m", prompt, output, t, "a10", 0.02)
        rec.arrived("m", t)
        out += [parse_trace(int(key.rsplit("_", 1)[1]), json.loads(raw)) for key, raw in rec.due(t + 10)]
    return out


def test_histogram_buckets_round_trip_within_two_percent() -> None:
    for tpot in (0.004, 0.0237, 0.05, 0.31):
        assert tpot_of_bucket(tpot_bucket(tpot)) == pytest.approx(tpot, rel=0.012)


def test_windows_carry_each_deployments_tpots_and_aibrix_layout_stays() -> None:
    rec = TraceRecorder()
    rec.completed("m", 200, 100, EPOCH + 1, "a10", 0.030)
    rec.completed("m", 200, 100, EPOCH + 2, "a10", 0.030)
    rec.completed("m", 200, 100, EPOCH + 3, "l20", 0.060)
    rec.completed("m", 200, 100, EPOCH + 4)  # no deployment known: counted in the cell only
    ((key, raw),) = rec.due(EPOCH + 20)
    value = json.loads(raw)
    assert value["76:66"] == 4 and value["meta_v"] == 4
    assert value[TPOT_KEY] == {"a10": {str(tpot_bucket(0.030)): 2}, "l20": {str(tpot_bucket(0.060)): 1}}
    w = parse_trace(EPOCH + 10, value)
    assert w.completed == 4 and w.tpot["a10"] == {tpot_bucket(0.030): 2}
    # AIBrix's GatewayLoadReader skips every key matching ^meta_: the cells it reads are unchanged
    assert [k for k in value if not k.startswith("meta_")] == ["76:66"]


@pytest.mark.parametrize("bad", [[1, 2], {"a10": [1]}, {"a10": {"x": 1}}, {"a10": {"3": -1}}])
def test_malformed_histograms_are_refused_naming_the_key(bad) -> None:
    with pytest.raises(WorkloadError, match=TPOT_KEY):
        parse_trace(EPOCH, {"70:30": 1, "meta_v": 4, TPOT_KEY: bad})


def test_a_type_that_misses_gets_a_smaller_factor_and_the_plan_moves_off_it() -> None:
    # 40 req/s: cheap 20 replicas ($20), then 25 at factor 0.8 ($25); dear 11 ($22), 10 at 1.1 ($20)
    cheap, dear = profile("cheap", 2.0, 1.0), profile("dear", 3.8, 2.0)
    mean = PlanSettings(headroom=0.0)  # plain loads: the counts above by hand
    fb = Feedback(first_seen={"cheap": EPOCH - 200, "dear": EPOCH - 200})
    now = EPOCH + 100
    # cheap: 5 % of its requests over the 50 ms target; dear: all well inside it
    ws = windows({"cheap": [0.030] * 19 + [0.070], "dear": [0.030]}, EPOCH + 40, 6, rps=40)
    before = replan(ws, now, 240, [cheap, dear], {}, None, mean).plan
    after = replan(ws, now, 240, [cheap, dear], {}, fb, mean).plan
    assert fb.outcomes["cheap"].attainment == pytest.approx(0.95)
    assert fb.factor("cheap") == pytest.approx(0.8)  # 1 - 5 x 4 %
    assert fb.factor("dear") == pytest.approx((40 / 30) ** 0.5, rel=0.01)  # P99 30 of 50 ms: sqrt(40 / 30)
    assert before is not None and after is not None
    assert before.replicas == {"cheap": 20, "dear": 0}
    assert after.replicas == {"cheap": 1, "dear": 9}  # each cheap replica is worth less, each dear more
    # it waits for windows that ended `settle_s` after the change before it moves again
    replan(ws, now + 10, 240, [cheap, dear], {}, fb, mean)
    assert fb.factor("cheap") == pytest.approx(0.8)


def test_no_move_in_the_first_span_nor_more_than_a_fifth_a_step() -> None:
    p = profile("a10", 2.0, 1.0)
    ws = windows({"a10": [0.09]}, EPOCH, 12)  # every request late
    fb = Feedback()
    fb.update(ws, EPOCH + 60, [p])
    assert fb.factor("a10") == 1.0  # a fleet just handed over is not the plan's doing
    fb.update(ws, EPOCH + 200, [p])
    assert fb.factor("a10") == pytest.approx(0.8)


def test_a_factor_recovers_and_goes_beyond_the_profile_only_with_room() -> None:
    p = profile("a10", 2.0, 1.0)
    room = windows({"a10": [0.020]}, EPOCH + 100, 8)        # P99 20 ms of a 50 ms SLO
    tight = windows({"a10": [0.030] * 49 + [0.045]}, EPOCH + 100, 8)  # all within, P99 45 ms
    fb = Feedback(factors={"a10": 0.5}, read_from={"a10": EPOCH + 90}, first_seen={"a10": EPOCH - 500})
    fb.update(tight, EPOCH + 180, [p])
    assert fb.factor("a10") == pytest.approx(0.55)  # back toward the benchmark either way
    fb = Feedback(first_seen={"a10": EPOCH - 500})
    fb.update(tight, EPOCH + 180, [p])
    assert fb.factor("a10") == 1.0  # no room: the benchmark stands
    fb.update(room, EPOCH + 180, [p])
    assert fb.factor("a10") == pytest.approx(1.25)  # room (P99 20 of 40 ms): at most a quarter a step
    fb = Feedback(factors={"a10": 1.95}, first_seen={"a10": EPOCH - 500})
    fb.update(room, EPOCH + 180, [p])
    assert fb.factor("a10") == 2.0  # never above twice the benchmark


def test_a_profile_measured_at_the_routers_budget_never_plans_above_it() -> None:
    # concurrency_admitted: the SLO router holds each pod at (about) that budget, so the room its P99
    # shows is the router's doing; even with the rate of the largest passing budget measured beside it
    data = {"gpu": "a10", "cost": 1.0, "tputs": [[2.0] * 2] * 2, "tputs_admitted": [[3.0] * 2] * 2,
            "concurrency_admitted": [[4] * 2] * 2, "indexes": [[16, 1024], [128, 4096]],
            "e2e": [[1.0] * 2] * 2, "slos": {"percentile": 99, "tpot": 0.05}, "created": 1.0,
            "tputs_admitted_max": [[4.5, 3.3], [3.0, 6.0]]}
    room = windows({"a10": [0.020]}, EPOCH + 100, 8)
    fb = Feedback(factors={"a10": 0.8}, first_seen={"a10": EPOCH - 500})
    fb.update(room, EPOCH + 180, [parse_profile(data)])
    assert fb.factor("a10") == 1.0  # back to the benchmark, not beyond
    fb.update(room, EPOCH + 400, [parse_profile(data)])
    assert fb.factor("a10") == 1.0


def test_a_raised_factor_is_judged_at_once_a_cut_one_after_the_fleet_settles() -> None:
    # a raise removes replicas, which serves at once: what the smaller fleet refuses is the raise's doing
    p = profile("a10", 2.0, 1.0)
    late = windows({"a10": [0.09]}, EPOCH + 20, 8)  # every request late, in windows after the change
    fb = Feedback(factors={"a10": 1.5}, read_from={"a10": EPOCH}, first_seen={"a10": EPOCH - 500})
    fb.update(late, EPOCH + 100, [p])
    assert fb.factor("a10") == pytest.approx(1.2)  # cut at once, by at most a fifth
    assert fb.read_from["a10"] == EPOCH + 100 + fb.settle_s  # a cut adds replicas: they settle first
    fb.update(late, EPOCH + 110, [p])
    assert fb.factor("a10") == pytest.approx(1.2)  # nothing read until then
    fb = Feedback(factors={"a10": 1.5}, first_seen={"a10": EPOCH - 500})
    fb.update(late, EPOCH + 100, [p], grew={"l20": EPOCH + 50})
    assert fb.factor("a10") == pytest.approx(1.2)  # another deployment's added replicas: no settle here
    fb = Feedback(factors={"a10": 1.5}, first_seen={"a10": EPOCH - 500})
    fb.update(late, EPOCH + 100, [p], grew={"a10": EPOCH + 50})
    assert fb.factor("a10") == 1.5  # its own replicas added at +50 are still starting: not the plan's doing


def test_few_requests_or_no_tpot_slo_leave_the_factor_alone() -> None:
    fb = Feedback()
    fb.first_seen["a10"] = EPOCH - 500
    ws = windows({"a10": [0.09]}, EPOCH, 1, rps=15)  # 150 requests, all late
    fb.update(ws, EPOCH + 20, [profile("a10", 2.0, 1.0)])
    assert fb.factor("a10") == 1.0 and fb.outcomes["a10"].completed == 150
    e2e_only = parse_profile({"gpu": "a10", "cost": 1, "tputs": [[1.0]], "indexes": [[16], [128]],
                              "slos": {"percentile": 99, "e2e": 2.0}})
    fb.update(windows({"a10": [0.09]}, EPOCH, 6), EPOCH + 60, [e2e_only])
    assert fb.factor("a10") == 1.0


def test_refused_requests_count_as_misses_of_the_deployments_that_could_have_served_them() -> None:
    # every TPOT well inside the SLO, but the router refused 3 % of a10's requests (its lane had no
    # room): the plan gave a10 too little, whatever the completed requests' TPOT says
    rec = TraceRecorder()
    out = []
    for k in range(8):
        t = EPOCH + 100 + 10 * k + 5
        for _ in range(97):
            rec.completed("m", 200, 100, t, "a10", 0.02)
        for _ in range(3):
            rec.rejected("m", ["a10"], t)
        rec.rejected("m", [], t)  # a refusal no deployment could have served: nobody's miss
        for key, raw in rec.due(t + 10):
            out.append(parse_trace(int(key.rsplit("_", 1)[1]), json.loads(raw)))
    assert out[0].rejected == {"a10": 3}
    seen = outcome(out, "a10", EPOCH, EPOCH + 200, 0.05)
    assert (seen.completed, seen.rejected, seen.attainment) == (776, 24, pytest.approx(0.97))
    fb = Feedback(first_seen={"a10": EPOCH - 500})
    fb.update(out, EPOCH + 200, [profile("a10", 2.0, 1.0)])
    assert fb.factor("a10") == pytest.approx(0.9)  # 97 %: shrunk, not grown for the room its P99 shows


@pytest.mark.parametrize("bad", [{"a10": -1}, {"a10": 1.5}, ["a10"], {"a10": True}])
def test_malformed_rejection_counts_are_refused_naming_the_key(bad) -> None:
    with pytest.raises(WorkloadError, match="meta_rejected"):
        parse_trace(EPOCH, {"meta_v": 4, "meta_rejected": bad})


def test_service_keys_match_trace_deployment_names() -> None:
    ws = windows({"l20": [0.02]}, EPOCH, 3)
    assert outcome(ws, "default/l20", EPOCH - 1, EPOCH + 40, 0.05).completed == 300
    assert outcome(ws, "default/xl20", EPOCH - 1, EPOCH + 40, 0.05).completed == 0


def test_scaled_profile_keeps_aibrix_fields() -> None:
    p = profile("a10", 2.0, 1.0)
    s = scaled(p, 0.5)
    assert s.tputs == p.tputs and s.served[0][0] == 1.0 and scaled(p, 1.0) is p


def test_the_dashboard_shows_what_the_gateways_observed_beside_the_plan() -> None:
    from extproc.optimizer.dashboard import dashboard_data, render_page
    from extproc.optimizer.deployments import Deployment
    from extproc.optimizer.monitor import ModelState

    state = ModelState("m", deployments={"default/a10": Deployment("default", "a10", "m", 1)})
    p = profile("default/a10", 2.0, 1.0)
    state.feedback.first_seen["default/a10"] = EPOCH - 500
    state.feedback.update(windows({"a10": [0.03] * 9 + [0.06]}, EPOCH, 12), EPOCH + 120, [p])
    [row] = dashboard_data(state, {"default/a10": p}, EPOCH + 120)["deployments"]
    assert row["observed"] == {"completed": 1200, "rejected": 0, "attainment": 0.9, "metric": "tpot",
                               "p99_s": pytest.approx(0.06, rel=0.02)}
    assert row["factor"] == pytest.approx(0.8)
    assert "P99 ms" in render_page(dashboard_data(state, {"default/a10": p}, EPOCH + 120))


def test_no_raise_while_the_router_refuses_any_of_the_models_requests() -> None:
    # the P99 of what the router admitted shows room because the router held each pod at its budget:
    # with refusals in the span that room is the router's doing, not spare capacity
    p = profile("a10", 2.0, 1.0)
    rec = TraceRecorder()
    out = []
    for k in range(8):
        t = EPOCH + 100 + 10 * k + 5
        for _ in range(100):
            rec.arrived("m", t)
            rec.completed("m", 200, 100, t, "a10", 0.020)  # P99 20 ms of 50: room
        if k == 3:
            rec.rejected("m", ["l20"], t)  # one refusal, another type's: a10 keeps 100 % attainment
        out += [parse_trace(int(key.rsplit("_", 1)[1]), json.loads(raw)) for key, raw in rec.due(t + 10)]
    fb = Feedback(first_seen={"a10": EPOCH - 500})
    fb.update(out, EPOCH + 180, [p])
    assert fb.outcomes["a10"].attainment == 1.0
    assert fb.factor("a10") == 1.0
    fb.update(out[:3] + out[4:], EPOCH + 180, [p])  # the same windows without the refusal
    assert fb.factor("a10") == pytest.approx(1.25)
    fb = Feedback(factors={"a10": 1.5}, first_seen={"a10": EPOCH - 500})
    fb.update(out, EPOCH + 180, [p])  # a raised type, and a refusal: the raise goes back toward 1
    assert fb.factor("a10") == pytest.approx(1.2)


def test_strain_is_a_refusal_or_the_slo_missed_in_the_windows() -> None:
    """What tells a burst the fleet absorbs from one it cannot (workload.trace_rates): any refusal, or
    fewer than the target of the completed requests within their deployment's TPOT SLO."""
    a10, l20 = profile("a10", 2.0, 1.0), profile("l20", 2.0, 2.0, tpot=0.1)
    calm = windows({"a10": [0.02] * 99 + [0.06], "l20": [0.09]}, EPOCH, 2, rps=20)  # a10 99 % in 50 ms
    assert not strained(calm, [a10, l20], 0.99)
    slow = windows({"a10": [0.02] * 97 + [0.06] * 3, "l20": [0.09]}, EPOCH, 2, rps=20)  # 98.5 % pooled
    assert strained(slow, [a10, l20], 0.99)
    assert not strained(slow, [a10, l20], 0.98)
    rec = TraceRecorder()
    rec.completed("m", 200, 100, EPOCH + 5, "a10", 0.02)
    rec.rejected("m", ["l20"], EPOCH + 6)  # one refusal, even another type's
    [(key, raw)] = rec.due(EPOCH + 20)
    assert strained([parse_trace(int(key.rsplit("_", 1)[1]), json.loads(raw))], [a10, l20], 0.99)
    # no TPOT SLO stated: strain cannot be read, so a burst is planned for
    e2e_only = parse_profile({"gpu": "a10", "cost": 1.0, "tputs": [[2.0] * 2] * 2,
                              "indexes": [[16, 1024], [128, 4096]], "e2e": [[1.0] * 2] * 2,
                              "slos": {"percentile": 99, "e2e": 2.0}, "created": 1.0})
    assert strained(calm, [e2e_only], 0.99)
    # windows without TPOT histograms (an AIBrix gateway writes none): nothing to read, so planned for
    aibrix = [parse_trace(EPOCH + 10, {"76:66": 100, "meta_v": 4, "meta_total_reqs": 100})]
    assert strained(aibrix, [a10, l20], 0.99)


def test_a_replan_leaves_a_burst_the_fleet_absorbs_to_the_router() -> None:
    """The same burst: the plan stays put while every request keeps its SLO and grows at once when
    the burst's windows show misses (planning.replan judges strain with the feedback's target)."""
    p = profile("a10", 2.0, 1.0)
    steady = windows({"a10": [0.02]}, EPOCH, 22)  # 10 req/s for 220 s
    burst_ok = windows({"a10": [0.02]}, EPOCH + 220, 2, rps=15)
    burst_missed = windows({"a10": [0.02] * 9 + [0.09]}, EPOCH + 220, 2, rps=15)
    now = EPOCH + 241

    def replicas(ws) -> tuple[int, bool | None]:
        fb = Feedback(first_seen={"a10": now})  # no factor moves: only the rates differ
        result = replan(ws, now, 240, [p], {"a10": 5}, fb, PlanSettings(headroom=0))
        return result.plan.replicas["a10"], result.burst and result.burst.planned

    assert replicas(steady + burst_ok) == (5, False)  # 10 req/s / 2 per replica; the burst is reported
    assert replicas(steady + burst_missed) == (8, True)  # 15 req/s, read at once
    assert replicas(steady)[1] is None


def test_an_add_the_running_fleet_has_room_for_is_held() -> None:
    """15 req/s at 2 per replica is 7.5 replicas of load; with its headroom (β = 0.5) the plan asks for a
    ninth. While the eight running keep 99.5 % of requests within the SLO and refuse nothing, and carry
    the load with half the headroom (7.5 + 0.48), they are kept (planning._held). A fleet below that bar
    (99.3 %: the SLO kept, the room not shown), or one without half the headroom, gets the add at once.
    Removals are never held."""
    p = profile("a10", 2.0, 1.0)
    now = EPOCH + 241
    calm = windows({"a10": [0.02]}, EPOCH, 24, rps=15)
    short_of_room = windows({"a10": [0.02] * 149 + [0.09]}, EPOCH, 24, rps=15)  # 1 in 150 over 50 ms

    def replan_once(ws, running: int):
        fb = Feedback(first_seen={"a10": now})  # no factor moves: only the strain differs
        return replan(ws, now, 240, [p], {"a10": running}, fb, PlanSettings(headroom=0.5))

    assert replan_once(calm, 9).plan.replicas == {"a10": 9}  # what the plan asks for
    assert replan_once(calm, 9).held is None
    held = replan_once(calm, 8)
    assert held.plan.replicas == {"a10": 8} and held.plan.cost == pytest.approx(8.0)
    assert held.held == {"a10": 9}  # what the plan asked for, for the dashboard and the log
    assert held.plan.load == pytest.approx({"a10": 7.5})
    assert replan_once(short_of_room, 8).plan.replicas == {"a10": 9}
    assert replan_once(calm, 7).plan.replicas == {"a10": 9}  # 7 cannot carry 7.5
    assert replan_once(calm, 12).plan.replicas == {"a10": 9}  # scaling down as before
    # 16 req/s on 8: they carry the bare load (8.0), not half the headroom (8.5): the add is made
    assert replan_once(windows({"a10": [0.02]}, EPOCH, 24, rps=16), 8).plan.replicas == {"a10": 9}


def test_the_hold_counts_the_load_as_the_router_routes_it() -> None:
    """Requests of 181 tokens sit in trace bucket 75, centred on the line between a 128-token cell (4
    req/s a replica) and a 256-token one (2): the plan maps the bucket by its centre, whole to the
    slower cell (15 req/s = 7.5 replicas; 9 with its headroom). The hold reads it as the router routes
    it, half on each side (5.6 replicas), so 7 running with room are kept, where by the centre they
    could not carry the load at all. The plan itself keeps the heavier count (docs/optimizer.md says
    why: margin for a stall its profiles do not see)."""
    p = parse_profile({"gpu": "a10", "cost": 1.0, "tputs": [[4.0, 2.0], [4.0, 2.0]],
                       "indexes": [[16, 1024], [128, 256]], "e2e": [[1.0] * 2] * 2,
                       "slos": {"percentile": 99, "tpot": 0.05}, "created": 1.0})
    now = EPOCH + 241
    calm = shaped_windows({(181, 100): 150})

    def replan_once(running: int):
        fb = Feedback(first_seen={"a10": now})
        return replan(calm, now, 240, [p], {"a10": running}, fb, PlanSettings(headroom=0.5))

    assert replan_once(9).plan.replicas == {"a10": 9}
    held = replan_once(7)
    assert held.plan.replicas == {"a10": 7} and held.held == {"a10": 9}
    assert held.plan.load == pytest.approx({"a10": 5.625})
    assert replan_once(6).plan.replicas == {"a10": 9}  # 5.6 and half the headroom do not fit in 6


def test_an_add_is_held_beside_a_shape_no_type_serves() -> None:
    """A few 4K-token prompts no profile serves are left out of the plan and named (`unserved`); the
    chat beside them is the add above, held on 8 running. Their trace bucket (128 output tokens) sits on
    a cell line, so the hold's routed count sees it as two cells: what it names is the plan's."""
    p = parse_profile({"gpu": "a10", "cost": 1.0, "tputs": [[2.0, 0.0], [2.0, 0.0]],
                       "indexes": [[16, 1024], [128, 4096]], "e2e": [[1.0] * 2] * 2,
                       "slos": {"percentile": 99, "tpot": 0.05}, "created": 1.0})
    now = EPOCH + 241
    calm = shaped_windows({(200, 100): 150, (4000, 128): 2})
    fb = Feedback(first_seen={"a10": now})
    asked = replan(calm, now, 240, [p], {"a10": 9}, fb, PlanSettings(headroom=0.5)).plan
    held = replan(calm, now, 240, [p], {"a10": 8}, fb, PlanSettings(headroom=0.5))
    assert asked.replicas == {"a10": 9} and asked.unserved
    assert held.plan.replicas == {"a10": 8} and held.held == {"a10": 9}
    assert held.plan.unserved == asked.unserved and held.plan.skipped == asked.skipped == 1


def test_a_swap_is_not_held() -> None:
    """A plan that adds one type while it removes another is made as it is: held, it would keep the
    replicas it replaces (the initial fleet's dear ones). The 7 running carry the 5 replicas of load."""
    cheap, dear = profile("cheap", 2.0, 1.0), profile("dear", 2.0, 5.0)
    now = EPOCH + 241
    calm = windows({"cheap": [0.02], "dear": [0.02]}, EPOCH, 24)
    fb = Feedback(first_seen={"cheap": now, "dear": now})
    running = {"cheap": 3, "dear": 4}
    plan = replan(calm, now, 240, [cheap, dear], running, fb, PlanSettings(headroom=0.5)).plan
    assert plan.replicas == {"cheap": 6, "dear": 0}


def test_the_dashboard_says_when_an_add_is_held() -> None:
    from extproc.optimizer.dashboard import dashboard_data, render_page
    from extproc.optimizer.deployments import Deployment
    from extproc.optimizer.monitor import ModelState

    state = ModelState("m", deployments={"default/a10": Deployment("default", "a10", "m", 1)})
    p = profile("default/a10", 2.0, 1.0)
    fb = Feedback(first_seen={"default/a10": EPOCH + 241})
    calm = windows({"a10": [0.02]}, EPOCH, 24, rps=15)
    result = replan(calm, EPOCH + 241, 240, [p], {"default/a10": 8}, fb, PlanSettings(headroom=0.5))
    state.apply(EPOCH + 241, result.demands, result.plan, result.error, result.burst, result.held)
    data = dashboard_data(state, {"default/a10": p}, EPOCH + 241)
    assert data["held"] == {"default/a10": 9} and data["plan"]["replicas"] == {"default/a10": 8}
    assert "held: the plan asks for" in render_page(data)
    state.apply(EPOCH + 251, result.demands, result.plan, result.error)  # the next re-plan holds nothing
    assert dashboard_data(state, {"default/a10": p}, EPOCH + 251)["held"] is None


def slo_profile(name: str, slos: dict[str, float]):
    return parse_profile({"gpu": name, "cost": 1.0, "tputs": [[2.0] * 2] * 2,
                          "indexes": [[16, 1024], [128, 4096]], "e2e": [[1.0] * 2] * 2,
                          "slos": {"percentile": 99, **slos}, "created": 1.0})


def latency_windows(ttft_s: float, e2e_s: float, count: int = 12, slow_e2e_s: float | None = None) -> list:
    """`count` 10 s windows from EPOCH, 100 completions each on a10 (200 + 100 tokens): TPOT 20 ms, the
    given TTFT and E2E (every tenth request 3x slower to its first token, and `slow_e2e_s` to its end)."""
    rec = TraceRecorder()
    out = []
    for k in range(count):
        t = EPOCH + 10 * k + 5
        for j in range(100):
            tenth = j % 10 == 0
            rec.completed("m", 200, 100, t, "a10", 0.02, ttft_s * (3 if tenth else 1),
                          slow_e2e_s if tenth and slow_e2e_s is not None else e2e_s)
        out += [parse_trace(int(key.rsplit("_", 1)[1]), json.loads(raw)) for key, raw in rec.due(t + 10)]
    return out


def test_ttft_e2e_and_tpat_histograms_round_trip_through_the_trace() -> None:
    [w] = latency_windows(0.2, 2.5, count=1)
    assert sum(w.ttft["a10"].values()) == sum(w.e2e["a10"].values()) == sum(w.tpot["a10"].values()) == 100
    assert sum(w.tpat["a10"].values()) == 100
    assert tpot_of_bucket(max(w.ttft["a10"])) == pytest.approx(0.6, rel=0.012)
    assert tpot_of_bucket(max(w.e2e["a10"])) == pytest.approx(2.5, rel=0.012)
    assert tpot_of_bucket(max(w.tpat["a10"])) == pytest.approx(2.5 / 300, rel=0.012)  # 200 + 100 tokens
    with pytest.raises(WorkloadError, match="meta_ttft"):
        parse_trace(EPOCH, {"70:30": 1, "meta_v": 4, "meta_ttft": {"a10": {"x": 1}}})


def test_a_ttft_slo_is_fed_back_from_the_ttft_the_traces_carry() -> None:
    """TPOT is fine (20 ms); a tenth of the requests take 3x the TTFT: against a 0.5 s TTFT SLO they
    miss (90 %) and the factor is cut; against 1 s they keep it. A profile naming TPOT and TTFT is
    judged on the one it keeps worst."""
    ws = latency_windows(0.2, 2.5)
    for slos, cut in (({"ttft": 0.5}, True), ({"ttft": 1.0}, False), ({"tpot": 0.05, "ttft": 0.5}, True),
                      ({"tpot": 0.05}, False), ({"e2e": 2.0}, True)):
        f = Feedback()
        f.first_seen["a10"] = EPOCH - 500
        f.update(ws, EPOCH + 120, [slo_profile("a10", slos)])
        assert (f.factor("a10") < 1.0) == cut, slos
        if cut:
            assert f.outcomes["a10"].metric == ("e2e" if "e2e" in slos else "ttft")
    assert strained(ws[-2:], [slo_profile("a10", {"ttft": 0.5})], 0.99)
    assert not strained(ws[-2:], [slo_profile("a10", {"ttft": 1.0})], 0.99)


def test_a_tpat_slo_is_fed_back_from_e2e_over_every_token() -> None:
    """E2E over 300 tokens: a tenth of the requests at 3x (6 s: 20 ms a token), the rest at 2 s (6.7 ms).
    A 10 ms TPAT SLO is missed by that tenth and the factor cut; 25 ms is kept. Before the traces
    carried TPAT, a TPAT-only profile had no outcome at all."""
    ws = latency_windows(0.2, 2.0, slow_e2e_s=6.0)
    for target, cut in ((0.01, True), (0.025, False)):
        f = Feedback()
        f.first_seen["a10"] = EPOCH - 500
        f.update(ws, EPOCH + 120, [slo_profile("a10", {"tpat": target})])
        assert f.outcomes["a10"].metric == "tpat"
        assert (f.factor("a10") < 1.0) == cut, target

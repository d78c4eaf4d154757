"""The rate search: early give-up agrees with a full run (under each SLO metric), the upper bound,
job-count independence."""

from __future__ import annotations

import pytest

from extproc.fleetsim.arrivals import generate
from extproc.fleetsim.loop import run
from extproc.fleetsim.maxrate import alone, find_max_rates, meets_slo
from extproc.fleetsim.metrics import summarize
from extproc.fleetsim.runner import Options
from tests.unit.fleetsim.conftest import small


@pytest.mark.parametrize("scale, slo", [(0.5, None), (12.0, None),  # the default: P99 TPOT 50 ms
                                        (0.5, {"e2e_s": 4.0}), (12.0, {"e2e_s": 4.0}),
                                        (0.5, {"tpat_s": 0.05}), (12.0, {"tpat_s": 0.05})])
def test_giving_up_early_agrees_with_the_full_run(scale, slo):
    sc = (small(slo=slo) if slo else small()).scaled(scale)
    full = run(sc, "least-request", generate(sc, 0, 1))
    expected = summarize(full)["slo_met"]
    early = run(sc, "least-request", generate(sc, 0, 1), give_up=True)
    assert meets_slo(sc, "least-request", Options()) is expected
    assert early.gave_up is (not expected)
    if not expected:  # the point of giving up: the failing run stops before its arrivals end
        assert early.end_time < sc.duration_s < full.end_time


def test_a_run_that_meets_the_slo_never_gives_up():
    sc = small().scaled(0.5)
    res = run(sc, "least-request", generate(sc, 0, 1), give_up=True)
    assert not res.gave_up and summarize(res)["slo_met"]


def test_alone_keeps_one_gpu_type_and_its_losses():
    sc = small(events=[{"kind": "lose-replicas", "at": 5, "gpu": "A100", "fraction": 0.5},
                       {"kind": "lose-replicas", "at": 6, "gpu": "L20", "fraction": 0.5}])
    cut = alone(sc, "L20")
    assert [g.gpu for g in cut.groups] == ["L20"]
    assert [x.gpu for x in cut.losses] == ["L20"]
    assert cut.streams == sc.streams and cut.slo == sc.slo


def test_bound_sums_each_type_alone():
    sc = small(duration_s=10)
    rates = find_max_rates(sc, ["least-request", "random"], Options(jobs=1), precision=0.1)
    by_gpu = rates["bound_by_gpu"]
    assert set(by_gpu) == {"L20", "A100-80GB"} and all(v and v > 0 for v in by_gpu.values())
    assert rates["bound_rps"] == pytest.approx(sum(by_gpu.values()))
    # the faster type alone serves more than the slower one alone
    assert by_gpu["A100-80GB"] > by_gpu["L20"]
    assert all(rps is not None and rps > 0 for rps in rates["strategies"].values())


def test_a_type_too_slow_for_the_slo_even_idle_adds_nothing_to_the_bound():
    # 18 ms per token: an idle L20 (~23 ms) cannot meet it, an A100 (~13 ms) can at low load.
    sc = small(duration_s=10, slo={"tpot_s": 0.018})
    rates = find_max_rates(sc, ["least-request"], Options(jobs=1), precision=0.2)
    assert rates["bound_by_gpu"]["L20"] is None
    assert rates["bound_rps"] == pytest.approx(rates["bound_by_gpu"]["A100-80GB"])


def test_same_rates_whatever_the_job_count():
    sc = small(duration_s=8)
    one = find_max_rates(sc, ["least-request", "load-balance"], Options(jobs=1), precision=0.1)
    two = find_max_rates(sc, ["least-request", "load-balance"], Options(jobs=2), precision=0.1)
    assert one == two

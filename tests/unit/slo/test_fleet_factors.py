"""The GPU optimizer's feedback cuts reach the SLO router (extproc/slo/fleet_factors.py): only cuts travel,
a bad value reads as none, a cut deployment's pods admit that share of their budgets, the gateway's
refresh reads them from Redis and keeps them through an outage."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from extproc.config import parse
from extproc.gpu_profiles import parse_profile
from extproc.server.gateway import Gateway
from extproc.slo.fleet_factors import FLOOR, decode, encode, factors_key, ttl_seconds
from extproc.slo.model import Signature, build_table
from extproc.slo.refresh import SloRefresh
from extproc.slo.state import SloState, learned


def admitted(gpu: str, budget: int) -> object:
    """One cell, measured at the router's budget (`concurrency_admitted`)."""
    return parse_profile({"gpu": gpu, "cost": 1.0, "tputs": [[2.0]], "indexes": [[8], [128]], "e2e": [[1.0]],
                          "tputs_admitted": [[2.0]], "concurrency_admitted": [[budget]],
                          "slos": {"percentile": 99, "tpot": 0.05}, "created": 1.0})


SIG = Signature(100, 8)


def test_only_cuts_travel_and_a_bad_value_reads_as_none() -> None:
    raw = encode({"a10": 0.8, "l20": 1.0, "h100": 1.6}, now=5.0)
    assert json.loads(raw) == {"factors": {"a10": 0.8}, "at": 5.0}
    assert decode(raw) == {"a10": 0.8}
    assert decode(None) == {} and decode(b"") == {} and decode("not json") == {} and decode("[]") == {}
    assert decode(json.dumps({"factors": {"a": "0.5", "b": True, "c": math.nan, "d": 0.01, "e": 2.0}})) \
        == {"d": FLOOR}
    # the optimizer's `namespace/name` keys, read as the router's deployment names
    raw = encode({"prod/a10": 0.8, "dev/a10": 0.6, "prod/l20": 0.9}, now=1.0)
    assert decode(raw) == {"a10": 0.6, "l20": 0.9}
    assert factors_key("llama") == "extproc:slo_factors:llama"
    assert ttl_seconds(10) == 60 and ttl_seconds(30) == 180


def test_a_cut_deployments_pods_admit_that_share_of_their_budget() -> None:
    table = build_table({"a10": admitted("a10", 4), "l20": admitted("l20", 4), "v100": admitted("v100", 1)},
                        {"a10": 0.5, "v100": 0.5})
    assert table["l20"].consumption(SIG) == pytest.approx(0.25)  # not cut
    assert table["a10"].consumption(SIG) == pytest.approx(0.5)   # 2 requests a pod where the budget said 4
    assert table["v100"].consumption(SIG) == 1.0  # a whole pod at most: it still fits an idle one


def test_the_state_rebuilds_its_table_on_a_cut_and_keeps_it_across_profile_changes() -> None:
    state = SloState()
    state.set_profiles("m", {"a10": admitted("a10", 4)})
    before = state.table("m")
    state.set_cuts("m", {})
    assert state.table("m") is before  # unchanged: no rebuild
    state.split.store("m", (), 0.0, {})
    state.set_cuts("m", {"a10": 0.5})
    assert state.table("m")["a10"].consumption(SIG) == pytest.approx(0.5)
    assert state.table("m")["a10"].served(0, 0) == pytest.approx(1.0)  # half the profile's 2 req/s
    assert "m" not in state.split.assignments  # the split is solved again on the cut table
    state.set_profiles("m", {"a10": admitted("a10", 8)})  # a newer profile: the cut still applies
    assert state.table("m")["a10"].consumption(SIG) == pytest.approx(0.25)
    state.set_cuts("m", {})  # the key expired: the profile's own budget
    assert state.table("m")["a10"].consumption(SIG) == pytest.approx(0.125)


class CutsRedis:
    """`get` over a dict, failing on demand (the call SloRefresh.refresh_cuts makes)."""

    def __init__(self, data: dict[str, str]) -> None:
        self.data, self.down = data, False

    async def get(self, key: str) -> str | None:
        if self.down:
            raise ConnectionError("redis is down")
        return self.data.get(key)


def test_the_gateways_refresh_reads_the_cuts_and_keeps_them_through_an_outage() -> None:
    gw = Gateway(parse({"models": {"m": {"pods": [{"name": "a", "address": "10.0.0.1:8000",
                                                     "deployment": "a10"}]}},
                        "routing": {"default_strategy": "slo"}}, {}))
    state = learned(gw.router.state.store)
    state.set_profiles("m", {"a10": admitted("a10", 4)})
    redis = CutsRedis({factors_key("m"): encode({"a10": 0.5}, now=1.0)})
    refresh = SloRefresh(gw)
    asyncio.run(refresh.refresh_cuts(state, redis, ["m"]))
    assert state.table("m")["a10"].consumption(SIG) == pytest.approx(0.5)
    cut = {"model": "m", "deployment": "a10"}
    assert gw.registry.get_sample_value("extproc_slo_optimizer_cut", cut) == 0.5
    redis.down = True
    asyncio.run(refresh.refresh_cuts(state, redis, ["m"]))
    assert state.table("m")["a10"].consumption(SIG) == pytest.approx(0.5)  # kept
    redis.down, redis.data = False, {}
    asyncio.run(refresh.refresh_cuts(state, redis, ["m"]))
    assert state.table("m")["a10"].consumption(SIG) == pytest.approx(0.25)  # expired: none
    assert gw.registry.get_sample_value("extproc_slo_optimizer_cut", cut) is None

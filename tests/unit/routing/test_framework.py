from collections import Counter

import pytest

from extproc.openai import Request
from extproc.pool import Pod
from extproc.routing import PodView, RoutingSettings, UnknownStrategy, build, strategy_names

REQ = Request(model="m", path="/v1/chat/completions")


def views(*running: int) -> list[PodView]:
    return [PodView(Pod("m", f"p{i}", f"10.0.0.{i}:80"), r) for i, r in enumerate(running)]


def test_registry_names():
    assert {"random", "least-request"} <= set(strategy_names())
    with pytest.raises(UnknownStrategy):
        build("nope")


def test_least_request_picks_fewest():
    assert build("least-request").pick(REQ, views(3, 1, 2), 0.0).pod.name == "p1"


def test_least_request_breaks_ties_at_random():
    profile = build("least-request", RoutingSettings(seed=1))
    picks = Counter(profile.pick(REQ, views(0, 5, 0), 0.0).pod.name for _ in range(400))
    assert set(picks) == {"p0", "p2"} and min(picks.values()) > 150


def test_random_covers_all_pods():
    profile = build("random", RoutingSettings(seed=2))
    picks = Counter(profile.pick(REQ, views(9, 0, 0), 0.0).pod.name for _ in range(600))
    assert set(picks) == {"p0", "p1", "p2"} and min(picks.values()) > 150


def test_no_candidates_gives_none():
    assert build("least-request").pick(REQ, [], 0.0) is None

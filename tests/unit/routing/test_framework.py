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


def repeated_picks(profile, pods) -> list[str]:
    """The fallbacks as asking the strategy again over what is left would give them."""
    left, out = list(pods), []
    while left:
        nxt = profile.pick(REQ, left, 0.0)
        out.append(nxt.pod.name)
        left = [v for v in left if v is not nxt]
    return out


@pytest.mark.parametrize("strategy", ["least-request", "load-balance", "least-kv-cache"])
def test_one_scoring_pass_orders_pods_as_repeated_picks_would(strategy):
    """Per-pod scores (no ties): the ordered list from one pass is the sequence of picks over what is
    left, so the protocol's fallbacks keep their meaning while scoring once."""
    profile = build(strategy, RoutingSettings(seed=3))
    pods = [PodView(Pod("m", f"p{i}", f"10.0.0.{i}:80"), r, kv_free=f)
            for i, (r, f) in enumerate([(5, 0.5), (1, 0.9), (3, 0.7), (7, 0.3), (2, 0.8)])]
    ranked = profile.ranked(REQ, pods, 0.0)
    assert ranked is not None and [v.pod.name for v in ranked] == repeated_picks(profile, pods)


def test_the_order_passes_over_unusable_scores_last_and_breaks_ties_at_random():
    import random

    from extproc.routing.load_math import LowestScorePicker

    pods = views(0, 0, 0, 0, 0)
    inf, nan = float("inf"), float("nan")
    picker = LowestScorePicker(random.Random(4))
    firsts = Counter()
    for _ in range(200):
        order = [v.pod.name for v in picker.order(pods, [2.0, inf, 1.0, nan, 1.0])]
        assert set(order[:2]) == {"p2", "p4"} and order[2] == "p0" and set(order[3:]) == {"p1", "p3"}
        firsts[order[0]] += 1
    assert min(firsts.values()) > 60  # the tie at 1.0 goes either way


def test_best_first_takes_the_first_n_and_rotates_a_tie_at_random():
    import random

    from extproc.routing.ordering import best_first

    pods = views(0, 0, 0, 0)
    rng = random.Random(5)
    assert best_first([], [], 3, rng) == []
    assert best_first(pods, [3.0, 1.0, 2.0, 0.5], 0, rng) == []
    assert [v.pod.name for v in best_first(pods, [3.0, 1.0, 2.0, 0.5], None, rng)] == ["p3", "p1", "p2", "p0"]
    assert [v.pod.name for v in best_first(pods, [3.0, 1.0, 2.0, 0.5], 9, rng)] == ["p3", "p1", "p2", "p0"]
    firsts = Counter(best_first(pods, [1.0, 1.0, 1.0, 2.0], 2, rng)[0].pod.name for _ in range(300))
    assert set(firsts) == {"p0", "p1", "p2"} and min(firsts.values()) > 60  # the tie's first is random
    # a tiebreak orders within the tie only, after the rotation (stable): the lowest wins every time
    order = best_first(pods, [1.0, 1.0, 1.0, 0.0], None, rng, tiebreak=lambda v: -v.pod.address.count("2"))
    assert [v.pod.name for v in order][:2] == ["p3", "p2"]

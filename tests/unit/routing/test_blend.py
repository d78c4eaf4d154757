import math
from collections import Counter

import pytest

from extproc.routing import Profile, Router, RoutingSettings, StrategySpecError, UnknownStrategy
from extproc.routing.blend import compose, normalize, parse_spec
from extproc.routing.framework import MaxScorePicker, RandomPicker
from extproc.routing.settings import AutoBlendSettings
from tests.unit.routing.support import REQ, FixedScorer, names, registered, view

KNOWN = {"load-balance", "least-request", "prefix-cache", "random"}.__contains__
NO_AUTO_BLEND = AutoBlendSettings(load_balance_weight=0)


def spec(text):
    return parse_spec(text, KNOWN)


# -- parsing --------------------------------------------------------------------------------------------

def test_weights_default_to_1_and_zero_drops_a_strategy():
    s = spec(" Prefix-Cache:5 , load-balance , least-request:0 ")
    assert s.items == (("prefix-cache", 5), ("load-balance", 1))
    assert s.mentioned == {"prefix-cache", "load-balance", "least-request"}
    assert s.label == "load-balance,prefix-cache"  # names only: a bounded metric label


def test_weight_bounds():
    assert spec("load-balance:1000000").items == (("load-balance", 1000000),)
    assert spec("load-balance:0,least-request:1").items == (("least-request", 1),)


@pytest.mark.parametrize("text,fragment", [
    ("", "empty"),
    ("   ", "empty"),
    ("load-balance,,least-request", "empty strategy name"),
    (":3", "empty strategy name"),
    ("load-balance:1000001", "above 1000000"),
    ("load-balance:-1", "'-1'"),
    ("load-balance:1.5", "'1.5'"),
    ("load-balance:", "''"),
    ("load-balance:x", "'x'"),
    ("load-balance:1:2", "'1:2'"),
    ("load-balance:٣", "'٣'"),  # a Unicode digit is not an ASCII integer
    ("load-balance:0,least-request:0", "weight 0"),
    ("load-balance:0", "weight 0"),
    ("load-balance,load-balance:2", "named twice"),
    ("x" * 600, "longer than"),
])
def test_bad_values_name_the_bad_part(text, fragment):
    with pytest.raises(StrategySpecError, match=None) as err:
        spec(text)
    assert fragment in str(err.value)


def test_unknown_strategy_is_a_spec_error_and_a_key_error():
    with pytest.raises(UnknownStrategy) as err:
        spec("load-balance:2,nope")
    assert isinstance(err.value, StrategySpecError) and isinstance(err.value, KeyError)
    assert "'nope'" in str(err.value) and "load-balance" in str(err.value)  # lists the valid names


# -- normalisation --------------------------------------------------------------------------------------

def test_min_max_higher_and_lower_is_better():
    assert normalize([1.0, 2.0, 3.0], lower_is_better=False) == [0.0, 0.5, 1.0]
    assert normalize([1.0, 2.0, 3.0], lower_is_better=True) == [1.0, 0.5, 0.0]


def test_all_equal_scores_are_1():
    assert normalize([0.3, 0.3, 0.3], lower_is_better=True) == [1.0, 1.0, 1.0]
    assert normalize([7.0], lower_is_better=False) == [1.0]


def test_non_finite_or_unscored_is_0():
    assert normalize([1.0, math.inf, math.nan, 3.0, -math.inf], lower_is_better=True) == [1.0, 0, 0, 0, 0]
    assert normalize([math.inf, math.nan], lower_is_better=True) == [0.0, 0.0]
    assert normalize([math.inf, 2.0], lower_is_better=True) == [0.0, 1.0]  # one finite score: all equal


def test_an_outlier_is_clipped_to_median_plus_3_mad():
    # AIBrix's example: min–max alone made 333 look nearly as good as 91 because of 4534.67.
    raw = [91.0, 333.0, 4534.67]
    plain = [(4534.67 - s) / (4534.67 - 91) for s in raw]
    assert plain[1] > 0.94
    median, mad = 333.0, 242.0  # |deviations| 242, 0, 4201.67 → MAD 242
    high = median + 3 * mad
    assert normalize(raw, lower_is_better=True) == pytest.approx([1.0, (high - 333) / (high - 91), 0.0])


def test_two_pods_are_not_clipped():
    assert normalize([1.0, 1000.0], lower_is_better=False) == [0.0, 1.0]


def test_no_clip_when_mad_is_0():
    # median 5, deviations 0,0,0,95 → MAD 0: nothing to judge outliers by, plain min–max
    assert normalize([5.0, 5.0, 5.0, 100.0], lower_is_better=False) == [0.0, 0.0, 0.0, 1.0]


# -- blends ---------------------------------------------------------------------------------------------

def fixed(name, table, lower=False, exclusive=False):
    return lambda ctx: Profile(name, MaxScorePicker(ctx.rng), scorers=[(FixedScorer(table, lower), 1.0)],
                                    exclusive=exclusive)


def router(**auto):
    return Router(RoutingSettings(seed=5, auto_blend=AutoBlendSettings(**auto) if auto else NO_AUTO_BLEND))


def test_weights_are_divided_by_their_sum():
    pods = [view("a"), view("b"), view("c")]
    with registered("aff", fixed("aff", {"a": 1.0, "b": 0.0, "c": 0.5})), \
            registered("cost", fixed("cost", {"a": 9.0, "b": 1.0, "c": 5.0}, lower=True)):
        profile = router().profile_for("aff:3,cost:1", "m")
        assert profile.totals(REQ, pods, 0.0) == pytest.approx([0.75, 0.25, 0.5])
        assert profile.pick(REQ, pods, 0.0).pod.name == "a"
        # scaling both weights changes nothing; shifting them does
        assert router().profile_for("aff:300,cost:100", "m").totals(REQ, pods, 0.0) == \
            pytest.approx([0.75, 0.25, 0.5])
        assert router().profile_for("aff:1,cost:3", "m").pick(REQ, pods, 0.0).pod.name == "b"


def test_load_balance_inf_is_only_a_penalty_when_blended():
    # "hot" is past the KV guardrail (+Inf) but an affinity scorer loves it.
    pods = [view("hot", 0, kv_free=0.01), view("b", 2), view("c", 3)]
    with registered("aff", fixed("aff", {"hot": 1.0, "b": 0.0, "c": 0.0})):
        assert router().profile_for("aff:3,load-balance:1", "m").pick(REQ, pods, 0.0).pod.name == "hot"
        assert router().profile_for("aff:1,load-balance:3", "m").pick(REQ, pods, 0.0).pod.name == "b"
    assert router().profile_for("load-balance", "m").pick(REQ, pods, 0.0).pod.name == "b"  # alone: excluded


def test_exact_ties_are_random_not_first_by_name():
    pods = [view("a", 1), view("b", 1), view("c", 5)]
    profile = router().profile_for("least-request:1,load-balance:1", "m")
    picks = Counter(profile.pick(REQ, pods, 0.0).pod.name for _ in range(400))
    assert set(picks) == {"a", "b"} and min(picks.values()) > 140


def test_exclusive_strategy_routes_alone_whatever_else_is_named():
    pods = [view("a", 0), view("b", 30)]  # a gap the gate would act on
    with registered("slo-test", fixed("slo-test", {"a": 0.0, "b": 1.0}, exclusive=True)):
        r = router(load_balance_weight=1)
        for text in ("slo-test", "least-request:9,slo-test:1", "slo-test,load-balance:5"):
            profile = r.profile_for(text, "m")
            assert profile.filters == [] and profile.pick(REQ, pods, 0.0).pod.name == "b"
            assert r.resolve(r.parse(text), "m").items == (("slo-test", 1),)
        assert r.imbalance_total == {}


def test_a_strategy_that_does_not_score_cannot_be_blended():
    with pytest.raises(StrategySpecError, match="'random' cannot be blended"):
        router().profile_for("random,least-request", "m")


def test_compose_keeps_member_filters_and_hooks():
    class Hook:
        def post_choice(self, request, chosen, now): ...

    class Drop:
        def filter(self, request, pods, now):
            return [p for p in pods if p.pod.name != "b"]

    hook = Hook()
    member = Profile("x", RandomPicker(None), scorers=[(FixedScorer({}), 1.0)], filters=[Drop()], hooks_of=[hook])
    other = Profile("y", RandomPicker(None), scorers=[(FixedScorer({"a": 1.0}), 1.0)])
    blended = compose("x,y", [(member, 1), (other, 1)], None)
    assert hook in blended.plugins()
    assert names(blended.candidates(REQ, [view("a"), view("b")], 0.0)) == ["a"]

"""The speed estimate knows how much it knows (synthetic traces): a pod's own base from a few short
requests is noise beside its GPU type's, and scores inside that noise tie; a genuinely slower pod of
the same type is still seen as slower once the evidence says so; an estimate no recent traffic
supports drifts back to its type's and widens until a request re-measures it."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from extproc.openai import Request
from extproc.pool.pod import Pod
from extproc.routing.framework import PodView
from extproc.routing.load_balance import LoadBalanceScorer
from extproc.routing.load_math import LowestScorePicker
from extproc.routing.settings import LoadBalanceSettings
from extproc.state.speed import SpeedEstimator

A = [Pod("m", f"a{i}", f"10.0.0.{i}:8000", labels={"gpu": "A100"}) for i in range(3)]
V100 = Pod("m", "v100", "10.0.1.1:8000", labels={"gpu": "V100"})
REQUEST = Request("m", "/v1/chat/completions")


def short_requests(est: SpeedEstimator, pod: Pod, base: float, n: int, t: float, rng: random.Random,
                   tokens: int = 3, noise: float = 0.25) -> float:
    """`n` sequential requests of `tokens` + 1 output tokens each, 0.2 s apart, at batch 1; each one's
    time per token off by up to ±`noise` (a few intervals of a few ms: timer and scheduling jitter)."""
    for _ in range(n):
        t += 0.2
        est.observe(pod.key, base * rng.uniform(1 - noise, 1 + noise), 1.0, tokens, t)
    return t


def scores(est: SpeedEstimator, pods: list[Pod]) -> list[float]:
    views = [PodView(p, speed=est.speed(p.key)) for p in pods]
    return LoadBalanceScorer(LoadBalanceSettings()).score(REQUEST, views, 0.0)


def picks(est: SpeedEstimator, pods: list[Pod], n: int = 300) -> Counter[str]:
    views = [PodView(p, speed=est.speed(p.key)) for p in pods]
    picker = LowestScorePicker(random.Random(7))
    scored = LoadBalanceScorer(LoadBalanceSettings()).score(REQUEST, views, 0.0)
    return Counter(picker.pick(views, scored).pod.name for _ in range(n))


def test_identical_pods_known_from_a_few_requests_tie():
    for seed in range(20):  # whichever pod the noise favours, it is not preferred
        rng = random.Random(seed)
        est = SpeedEstimator()
        t = 0.0
        for pod in A:
            t = short_requests(est, pod, 0.010, 5, t, rng)
        est.refresh(A, t)
        fitted = [est.speed(p.key).base for p in A]
        assert max(fitted) / min(fitted) < 1.10, fitted  # shrunk together, not 25 % apart
        assert len(set(scores(est, A))) == 1, (seed, scores(est, A))
    counts = picks(est, A)
    assert min(counts[p.name] for p in A) > 60, counts  # at random among the three


def test_a_pod_30_percent_slower_is_seen_once_the_evidence_says_so():
    rng = random.Random(1)
    est = SpeedEstimator()
    t = 0.0
    for _ in range(60):  # 12 s of interleaved traffic, 100-token requests
        t = short_requests(est, A[0], 0.010, 1, t, rng, tokens=100, noise=0.05)
        t = short_requests(est, A[1], 0.013, 1, t, rng, tokens=100, noise=0.05)
    est.refresh(A[:2], t)
    fast, slow = (est.speed(p.key) for p in A[:2])
    assert slow.base / fast.base > 1.25
    s = scores(est, A[:2])
    assert s[1] > s[0]  # not a tie
    assert picks(est, A[:2]) == {"a0": 300}


def test_few_requests_do_not_make_a_slower_pod_out_of_an_unlucky_one():
    """The restart case: a sibling measured on hundreds of requests, the revived pod on three that came
    out 30 % slow. The three are noise beside the type's figure: the two tie and share the traffic."""
    rng = random.Random(2)
    est = SpeedEstimator()
    t = short_requests(est, A[0], 0.010, 200, 0.0, rng)
    t = short_requests(est, A[1], 0.013, 3, t, rng, noise=0.0)
    est.refresh(A[:2], t)
    assert est.speed(A[1].key).base < 0.0115
    assert len(set(scores(est, A[:2]))) == 1


def test_a_stale_estimate_drifts_back_to_its_type_and_is_re_measured():
    rng = random.Random(3)
    est = SpeedEstimator()
    t = 0.0
    for _ in range(60):  # both measured well; a1 was slow then (a noisy neighbour since gone)
        t = short_requests(est, A[0], 0.010, 1, t, rng, tokens=100, noise=0.05)
        t = short_requests(est, A[1], 0.014, 1, t, rng, tokens=100, noise=0.05)
    # from now on a0 alone serves (a1 gets nothing: it scored worse)
    t = short_requests(est, A[0], 0.010, 50, t, rng, tokens=100, noise=0.05)
    est.refresh(A[:2], t)
    then = est.speed(A[1].key)
    assert then.base > 0.013 and len(set(scores(est, A[:2]))) == 2  # still the slower one
    for _ in range(10):  # ten minutes
        t = short_requests(est, A[0], 0.010, 300, t, rng, tokens=100, noise=0.05)
        est.refresh(A[:2], t)
    now = est.speed(A[1].key)
    assert now.base < then.base and now.spread > then.spread  # back toward its type's, less sure
    assert len(set(scores(est, A[:2]))) == 1  # a tie again: it gets requests that re-measure it


def test_the_only_pod_of_its_type_is_re_measured_once_its_evidence_is_old():
    """No sibling to drift toward: its own spread widens as its evidence is forgotten, until its score
    ties with the best (the occasional request), while it is fresh it is the slower pod it is."""
    rng = random.Random(4)
    est = SpeedEstimator()
    pods = [A[0], V100]
    t = 0.0
    for _ in range(60):
        t = short_requests(est, A[0], 0.010, 1, t, rng, tokens=100, noise=0.05)
        t = short_requests(est, V100, 0.018, 1, t, rng, tokens=100, noise=0.05)
    est.refresh(pods, t)
    assert picks(est, pods)["v100"] == 0
    quiet = None
    for minute in range(1, 31):  # A100 alone serves, one request every 0.2 s
        for _ in range(300):
            t = short_requests(est, A[0], 0.010, 1, t, rng, tokens=100, noise=0.05)
        est.refresh(pods, t)
        if len(set(scores(est, pods))) == 1:
            quiet = minute
            break
    assert quiet is not None and quiet >= 3, quiet  # occasional: not within the first minutes
    assert est.speed(V100.key).base > 0.015  # still valued as the slower GPU it is


# -- shared between gateways ---------------------------------------------------------------------

def test_a_gateway_that_routed_nothing_fits_on_what_the_others_measured():
    rng = random.Random(5)
    a, b = SpeedEstimator(), SpeedEstimator()
    t = 0.0
    for _ in range(60):  # a routes everything
        t = short_requests(a, A[0], 0.010, 1, t, rng, tokens=100, noise=0.05)
        t = short_requests(a, A[1], 0.013, 1, t, rng, tokens=100, noise=0.05)
    a.refresh(A[:2], t)
    b.refresh(A[:2], t)
    assert b.speed(A[0].key) is None  # on its own, b knows nothing
    for pod in A[:2]:
        b.merge_peers(pod.key, [a.export(pod.key)])
    b.refresh(A[:2], t + 0.5)
    a.refresh(A[:2], t + 0.5)
    for pod in A[:2]:
        assert b.speed(pod.key).base == pytest.approx(a.speed(pod.key).base, rel=1e-6)
        assert b.speed(pod.key).saturated == pytest.approx(a.speed(pod.key).saturated, rel=1e-6)
    b.merge_peers(A[0].key, [])  # the others no longer heard from: its own records only
    b.refresh(A[:2], t + 1.0)
    assert b.speed(A[0].key).spread > a.speed(A[0].key).spread


def test_evidence_from_both_gateways_adds_up_to_one_fit():
    """Two gateways that each got half the records fit what one gateway with all of them fits."""
    rng = random.Random(6)
    one, a, b = SpeedEstimator(), SpeedEstimator(), SpeedEstimator()
    t = 0.0
    for i in range(200):
        t += 0.1
        batch = rng.uniform(1, 30)
        tpot = 0.010 * (1 + 0.02 * batch) * rng.uniform(0.95, 1.05)
        one.observe(A[0].key, tpot, batch, 50, t)
        (a if i % 2 else b).observe(A[0].key, tpot, batch, 50, t)
    a.merge_peers(A[0].key, [b.export(A[0].key)])
    one.refresh([A[0]], t)
    a.refresh([A[0]], t)
    assert a.speed(A[0].key).base == pytest.approx(one.speed(A[0].key).base, rel=1e-6)
    assert a.speed(A[0].key).shape == pytest.approx(one.speed(A[0].key).shape, rel=1e-6)


def test_malformed_peer_evidence_is_ignored():
    est = SpeedEstimator()
    short_requests(est, A[0], 0.010, 5, 0.0, random.Random(7), tokens=50)
    est.merge_peers(A[0].key, [[1.0, 2.0], [math.nan] * len(est.export(A[0].key))])
    est.refresh([A[0]], 2.0)
    assert est.speed(A[0].key).base == pytest.approx(0.010, rel=0.3)


def test_an_idle_pod_no_worse_by_its_estimate_beats_a_busy_one():
    rng = random.Random(8)
    est = SpeedEstimator()
    t = 0.0
    for pod in A:
        t = short_requests(est, pod, 0.010, 5, t, rng)
    est.refresh(A, t)
    views = [PodView(p, running=3 if i == 0 else 0, speed=est.speed(p.key)) for i, p in enumerate(A)]
    views[0] = PodView(A[0], running=3, speed=est.speed(A[0].key).__class__(
        est.speed(A[0].key).base * 0.97, 0.0, 1.0, 256, est.speed(A[0].key).spread))  # a shade faster, no slope
    scored = LoadBalanceScorer(LoadBalanceSettings()).score(REQUEST, views, 0.0)
    assert scored[1] == scored[2] < scored[0]


def test_a_merge_kept_between_refreshes_fits_as_a_merge_made_anew():
    """The others' sums merged once and reused while neither side moved (forgetting is multiplicative)
    give the fit a fresh merge gives; a record of its own, or a new read, makes it anew."""
    rng = random.Random(3)
    pods = [Pod("m", f"p{i}", f"10.0.0.{i}:8000", labels={"gpu": ("A100", "L20")[i % 2]}) for i in range(6)]
    ours, theirs = SpeedEstimator(), SpeedEstimator()
    for estimator in (ours, theirs):
        for p in pods:
            for _ in range(5):
                estimator.observe(p.key, 0.02 * (1 + rng.random() * 0.3), rng.uniform(1, 16), 100, 0.0)
                estimator.observe_prefill(p.key, 0.05 * rng.random(), rng.uniform(100, 900), 100, 0.0)
    peers = {p.key: [theirs.export(p.key)] for p in pods}

    def twin() -> SpeedEstimator:  # the same evidence, never refreshed before
        fresh = SpeedEstimator()
        fresh._pods = {k: type(v)(*(s.copy() for s in (v.recent, v.long, v.kv, v.prefill, v.mix)),
                                  v.measured, v.version) for k, v in ours._pods.items()}
        for key, vectors in peers.items():
            fresh.merge_peers(key, vectors)
        return fresh

    for p in pods:
        ours.merge_peers(p.key, peers[p.key])
    ours.refresh(pods, 1.0)
    merged_once = dict(ours._merged)
    ours.observe(pods[0].key, 0.03, 4.0, 100, 4.0)  # one record of its own: that pod's merge is stale
    ours.refresh(pods, 5.0)
    assert ours._merged[pods[1].key] is merged_once[pods[1].key]  # kept
    assert ours._merged[pods[0].key] is not merged_once[pods[0].key]  # made anew
    fresh = twin()
    fresh.refresh(pods, 5.0)
    for p in pods:
        kept, anew = ours.speed(p.key), fresh.speed(p.key)
        assert kept is not None and anew is not None
        assert kept.base == pytest.approx(anew.base, rel=1e-9)
        assert kept.shape == pytest.approx(anew.shape, rel=1e-9)
        assert kept.saturated == pytest.approx(anew.saturated, rel=1e-9)


def test_the_others_sums_as_one_array_fit_as_the_same_vectors_one_by_one():
    """RedisState's read comes as one array (PeerSums), its times on the wall clock: merged whole,
    shifted to the estimator's clock, it fits as the vectors handed over pod by pod do; a record of
    its own re-merges only that pod; a restarted pod stands aside until the next read."""
    import numpy as np

    from extproc.sharing.speed_sums import PeerSums, shifted

    rng = random.Random(4)
    pods = [Pod("m", f"p{i}", f"10.0.0.{i}:8000", labels={"gpu": ("A100", "L20")[i % 2]}) for i in range(6)]
    ours, theirs = SpeedEstimator(), SpeedEstimator()
    for estimator in (ours, theirs):
        for p in pods[:5]:  # the last pod: only theirs
            for _ in range(5):
                estimator.observe(p.key, 0.02 * (1 + rng.random() * 0.3), rng.uniform(1, 16), 100, 0.0)
                estimator.observe_prefill(p.key, 0.05 * rng.random(), rng.uniform(100, 900), 100, 0.0)
    theirs.observe(pods[5].key, 0.03, 3.0, 100, 0.5)
    wall = 1000.0  # their vectors on the wall clock: ours runs 1000 s behind it
    vectors = {p.key: shifted(theirs.export(p.key), wall) for p in pods}
    one_by_one = SpeedEstimator()
    one_by_one._pods = {k: type(v)(*(s.copy() for s in (v.recent, v.long, v.kv, v.prefill, v.mix)),
                                   v.measured, v.version) for k, v in ours._pods.items()}
    for p in pods:
        one_by_one.merge_peers(p.key, [shifted(vectors[p.key], -wall)])
    rows = {p.key: i for i, p in enumerate(pods)}
    ours.merge_peer_sums(PeerSums(rows, np.array([vectors[p.key] for p in pods])), -wall)
    for t in (2.0, 3.0):
        ours.refresh(pods, t)
        one_by_one.refresh(pods, t)
        for p in pods:
            got, want = ours.speed(p.key), one_by_one.speed(p.key)
            assert got is not None and want is not None
            assert (got.base, got.shape, got.saturated, got.spread) == pytest.approx(
                (want.base, want.shape, want.saturated, want.spread), rel=1e-9)
    kept = dict(ours._merged)
    ours.observe(pods[0].key, 0.03, 4.0, 100, 3.5)
    ours.refresh(pods, 4.0)
    assert ours._merged[pods[0].key] != kept[pods[0].key]  # merged anew (its own version moved)
    assert ours._merged[pods[1].key] is kept[pods[1].key]
    one_by_one.observe(pods[0].key, 0.03, 4.0, 100, 3.5)
    one_by_one.refresh(pods, 4.0)
    assert ours.speed(pods[0].key).base == pytest.approx(one_by_one.speed(pods[0].key).base, rel=1e-9)
    for p in pods:  # a new read: every merge set anew (in place), as the vectors one by one give
        theirs.observe(p.key, 0.05, 20.0, 100, 4.2)
    later = {p.key: shifted(theirs.export(p.key), wall) for p in pods}
    ours.merge_peer_sums(PeerSums(rows, np.array([later[p.key] for p in pods])), -wall)
    for p in pods:
        one_by_one.merge_peers(p.key, [shifted(later[p.key], -wall)])
    ours.refresh(pods, 4.5)
    one_by_one.refresh(pods, 4.5)
    for p in pods:
        got, want = ours.speed(p.key), one_by_one.speed(p.key)
        assert (got.base, got.shape, got.saturated) == pytest.approx((want.base, want.shape, want.saturated),
                                                                     rel=1e-9)
    assert pods[5].key in ours._evidence(pods, 5.0)
    ours.restarted(pods[5].key)  # known only from theirs: nothing until the next read
    assert pods[5].key not in ours._evidence(pods, 5.0)
    ours.merge_peer_sums(None)  # Redis away: each pod on its own records
    ours.refresh(pods, 6.0)
    alone = SpeedEstimator()
    alone._pods = ours._pods
    alone.refresh(pods, 6.0)
    assert ours.speed(pods[0].key).base == pytest.approx(alone.speed(pods[0].key).base, rel=1e-12)

"""`bench sync`'s check of the speed sums: each gateway's view of the others' sums on a pod is held
against the sum of every other gateway's written share, worked out apart from Redis's script."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from extproc.perf import sync
from extproc.sharing import speed_sums
from extproc.state.speed import SpeedEstimator


@dataclass
class _Core:
    _written_speed: dict = field(default_factory=dict)


@dataclass
class _Gateway:
    """What the check reads of a RedisState: its ledger's shares and its view of the others'."""

    core: _Core
    view: dict = field(default_factory=dict)

    def peer_speed(self) -> dict:
        return self.view


def _fleet(gateways: int = 3, pods: int = 4) -> tuple[list[_Gateway], list]:
    fleet = sync.make_pods(pods, 2)
    states = [_Gateway(_Core()) for _ in range(gateways)]
    for g, state in enumerate(states):
        estimator = SpeedEstimator()
        for p, pod in enumerate(fleet):
            if (g + p) % 3:  # some pods unmeasured by some gateways
                estimator.observe(pod.key, 0.02 + 0.001 * g, 4 + p, 199, 100.0 + g)
                estimator.observe_prefill(pod.key, 0.05, 500 + 10 * g, 200, 100.0 + g)
                state.core._written_speed[pod.key] = estimator.export(pod.key)
    for g, state in enumerate(states):  # each view as a reader makes it: the sums less its own share
        for pod in fleet:
            total = None
            for other in states:
                total = speed_sums.move(total, None, other.core._written_speed.get(pod.key))
            if total is not None and (v := speed_sums.others(total, state.core._written_speed.get(pod.key))):
                state.view[pod.key] = [v]
    return states, fleet


def test_exact_views_pass_and_every_pair_is_checked() -> None:
    states, fleet = _fleet()
    assert sum(len(s.view) for s in states) > 0  # not vacuous: there are views to hold
    assert sync.wrong_speed_sums(states, fleet) == (0, len(states) * len(fleet))


def test_a_view_off_by_one_record_a_missing_view_and_a_stale_one_are_each_counted() -> None:
    states, fleet = _fleet()
    key = next(iter(states[0].view))
    off = copy.deepcopy(states)
    off[0].view[key][0][-1] += 1.0  # one more record in the last group's count
    assert sync.wrong_speed_sums(off, fleet)[0] == 1
    missing = copy.deepcopy(states)
    del missing[1].view[next(iter(missing[1].view))]
    assert sync.wrong_speed_sums(missing, fleet)[0] == 1
    stale = copy.deepcopy(states)  # a share written after gateways 1 and 2 read: their views miss it
    writer = stale[0].core._written_speed
    key = next(k for k in writer if all(k in s.view for s in stale[1:]))
    writer[key] = [v + (1.0 if i == 8 else 0.0) for i, v in enumerate(writer[key])]  # group 0's n
    assert sync.wrong_speed_sums(stale, fleet)[0] == 2

"""The optimizer's tunable constants, one place for the live service and the fleet simulation's loop.

Every figure the plan depends on is a key here: the optimizer config's `planning:` section
(optimizer/deployments.py) and a fleet-sim scenario's `autoscale:` section (fleetsim/scenario.py) both
parse it with `parse_policy`, so the two cannot drift. A default is either a fixed figure or derived from
the schedule it serves (a replica's start-up `provision_s`, the re-plan `interval_s`, the trace
`window_s`); each carries the rule that chose it (docs/optimizer.md, "Constants"). None of them names a
scenario: where a figure was checked on simulation runs, the docs say which.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from extproc.config.source import line_of
from extproc.optimizer.config_errors import ConfigError, check_keys
from extproc.optimizer.feedback import CEILING as FEEDBACK_CEILING  # its rule is beside it
from extproc.optimizer.feedback import GAIN as FEEDBACK_GAIN
from extproc.optimizer.feedback import Feedback
from extproc.optimizer.solver import REMOVE_COST  # the rule is beside it

# β of the square-root staffing: the Halfin–Whitt point where about half the arrivals find every slot a
# replica admits busy and wait for one (P(wait) = 1 / (1 + β·Φ(β)/φ(β)) = 0.50 at β = 0.5); the SLO
# router's queue holds those waits within the request's deadline, and a smaller β makes most arrivals wait.
HEADROOM = 0.5
PROVISION_S = 60.0  # a replica's start: from the plan's ask to serving (image cached, weights loaded)
# The PodAutoscaler's scale-down stabilization (Kubernetes HPA's default, 300 s): the fleet simulation's
# stand-in for the autoscaler; the live optimizer does not scale, the HPA/KEDA object carries it.
STABILIZATION_S = 300.0

KEYS = frozenset({"headroom", "add_cost", "remove_cost", "provision_s", "feedback_span_s",
                  "feedback_settle_s", "feedback_gain", "feedback_ceiling"})


@dataclass(frozen=True, slots=True)
class PlanPolicy:
    """None: derived from the schedule by `resolved` (the rule is beside each field)."""

    headroom: float = HEADROOM
    # Of a replica's hourly cost, per replica a plan adds. None: provision_s / window_s. An added replica
    # is billed for provision_s before it serves; a swap must win that back over the horizon its demand
    # estimate averages (one trace window), else the next window may reverse it.
    add_cost: float | None = None
    remove_cost: float = REMOVE_COST
    provision_s: float = PROVISION_S
    feedback_span_s: float | None = None  # None: window_s / 2, the newer half of what the plan reads
    # None: provision_s + 3 x interval_s: the replicas a change asked for serving, then three re-plans'
    # trace windows of the fleet it produced before the feedback reads it
    feedback_settle_s: float | None = None
    feedback_gain: float = FEEDBACK_GAIN
    feedback_ceiling: float = FEEDBACK_CEILING

    def resolved(self, interval_s: float, window_s: float) -> PlanPolicy:
        """Every derived figure filled in for this re-plan schedule."""
        return replace(
            self,
            add_cost=self.provision_s / window_s if self.add_cost is None else self.add_cost,
            feedback_span_s=window_s / 2 if self.feedback_span_s is None else self.feedback_span_s,
            feedback_settle_s=(self.provision_s + 3 * interval_s if self.feedback_settle_s is None
                               else self.feedback_settle_s))

    def feedback(self) -> Feedback:
        """A fresh feedback with this policy's figures (call on a resolved policy)."""
        fb = Feedback(gain=self.feedback_gain, ceiling=self.feedback_ceiling)
        if self.feedback_span_s is not None:
            fb.span_s = self.feedback_span_s
        if self.feedback_settle_s is not None:
            fb.settle_s = self.feedback_settle_s
        return fb


def parse_policy(data: Mapping[str, Any], where: str, allowed: frozenset[str] = KEYS) -> PlanPolicy:
    """The policy keys of `data` (other keys must be in `allowed`). Refuses a bad value naming the key, its
    line and, for an unknown key, the one it is closest to. Raises ConfigError (a ValueError)."""
    check_keys(where, data, allowed)
    values: dict[str, float] = {}
    for key in KEYS & set(data):
        raw = data[key]
        if raw is None and key in ("add_cost", "feedback_span_s", "feedback_settle_s"):
            continue  # explicitly derived
        bad = isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw)
        low = _LOWEST.get(key, 0.0)
        if bad or raw < low or (key in _POSITIVE and raw <= 0):
            need = "> 0" if key in _POSITIVE else f">= {low:g}"
            raise ConfigError(f"{where}.{key}{line_of(data, key)}: expected a number {need}, got {raw!r}")
        values[key] = float(raw)
    return PlanPolicy(**values)


_POSITIVE = frozenset({"feedback_span_s", "feedback_gain"})
_LOWEST = {"feedback_ceiling": 1.0}  # below 1 the feedback could never return a type to its benchmark

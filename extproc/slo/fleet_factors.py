"""The GPU optimizer's feedback cuts, as the gateways' SLO routers read them (pure: key, encode, decode).

The optimizer keeps a factor per deployment on what its profile says a replica serves (optimizer/
feedback.py): below 1 when the deployment's requests missed the SLO at that rate, and the plan then
counts its replicas at that share. The SLO router admits to a pod by the same profile (a request holds
1/budget of it, slo/model.py), so without the factor it keeps sending a short type what the plan no
longer counts on it for, and the misses stay where they were. So the optimizer publishes its cuts under
one Redis key per model, and every gateway's router holds each pod of a cut deployment to that share of
its budget (the request's consumption divided by the factor), and `slo`'s split of shapes over types
counts its pods at that share of their throughput: router and plan count the same replica again.
Only cuts travel: a raise above the benchmark reads room the router already uses (it admits past a
pod's budget while the pod's measured speed shows room, slo/pulling.py). The key expires
(`ttl_seconds`): a stopped optimizer's last cuts do not outlive it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

FLOOR = 0.05  # below this a factor is read as this: a deployment is never closed by a factor alone


def factors_key(model: str) -> str:
    return f"extproc:slo_factors:{model}"


def ttl_seconds(replan_interval_s: float) -> int:
    """Six re-plans, at least a minute: a missed cycle or two keep the cuts, a stopped optimizer not."""
    return max(60, math.ceil(6 * replan_interval_s))


def encode(factors: Mapping[str, float], now: float) -> str:
    """The cuts (factors below 1) of one model's deployments, named as their profiles name them."""
    return json.dumps({"factors": {d: round(f, 4) for d, f in sorted(factors.items()) if f < 1.0},
                       "at": now})


def decode(raw: str | bytes | None) -> dict[str, float]:
    """deployment -> cut in [FLOOR, 1), named as the SLO router names deployments: the optimizer keys a
    deployment `namespace/name` (gpu_profiles.deployment_key), the router by its name, so the name is
    kept (the smaller cut where two namespaces share one). {} for a missing or malformed value: no cut
    is the safe reading, the profiles' own budgets."""
    if not raw:
        return {}
    try:
        factors = json.loads(raw)["factors"]
        cuts: dict[str, float] = {}
        for key, f in factors.items():
            if isinstance(f, int | float) and not isinstance(f, bool) and math.isfinite(f) and f < 1.0:
                name = str(key).rsplit("/", 1)[-1]
                cuts[name] = min(cuts.get(name, 1.0), max(FLOOR, float(f)))
        return cuts
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}

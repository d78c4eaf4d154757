"""The load model: what one request of a given signature costs a pod of a given deployment.

Each deployment's profile says, per (output, input) cell, the request rate `tput` a pod sustains while
meeting the SLO and the latency `e2e` it has there. By Little's law such a pod holds tput × e2e requests
at once, so one request takes 1 / (tput × e2e) of it: its *consumption*. A pod's utilization is the sum of
its in-flight consumptions, capacity 1.0. A cell with tput 0 means this GPU type cannot meet the SLO for
that shape at any rate.

Profiles without `e2e` (older AIBrix files, the shipped A40 one) are never treated as free: the latency
is estimated from the SLO target when the profile states one (at the SLO rate the latency is at most the
target, so this under-counts consumption by at most target/e2e) and a log line says so; a profile with
neither is left out, and its deployment's pods are routed by the fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

from extproc.gpu_profiles import GpuProfile

log = logging.getLogger(__name__)

# Which SLO the urgency is measured in when a profile states several (AIBrix's precedence).
METRIC_PRECEDENCE = ("tpot", "ttft", "tpat", "e2e")


def tokens_per(metric: str | None, input_tokens: int, output_tokens: int) -> int:
    """The tokens an SLO metric is per (a per-token target times this is the request's latency budget):
    TPOT the output's, TPAT every token (AIBrix's time per all tokens, E2E / (prompt + output): its
    gen_profile and SLO queue), at least 1; a latency (TTFT, E2E) is per request: 1."""
    if metric == "tpat":
        return max(1, input_tokens + output_tokens)
    if metric == "tpot":
        return max(1, output_tokens)
    return 1


@dataclass(frozen=True, slots=True)
class Signature:
    """A request's shape: prompt tokens and predicted output tokens."""

    input_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class DeploymentModel:
    name: str
    profile: GpuProfile
    e2e: tuple[tuple[float, ...], ...]   # the profile's, or estimated (see `estimated`)
    metric: str | None                   # the SLO the queue's urgency is measured in; None: no target
    target: float | None
    estimated: bool = False
    # The GPU optimizer's feedback factor on this deployment (slo/fleet_factors.py): below 1 its pods
    # missed the SLO at the profile's budget, and a pod holds that share of it, as the plan counts it.
    admission: float = 1.0

    def cell(self, sig: Signature) -> tuple[int, int]:
        return self.profile.cell(sig.input_tokens, sig.output_tokens)

    def served(self, o: int, i: int) -> float:
        """Requests/s one pod serves of cell (o, i) within the SLO: the profile's, at the optimizer's cut."""
        return self.profile.served[o][i] * self.admission

    def consumption(self, sig: Signature) -> float | None:
        """The share of a pod one such request holds; None: this deployment cannot meet the SLO.

        At most 1: where tput × e2e < 1 a pod meets the SLO only serving such requests one at a time,
        so one of them takes a whole (idle) pod. Uncapped, it would fit nowhere and wait at the head of
        the queue until its deadline, holding up everyone behind it."""
        o, i = self.cell(sig)
        tput, e2e = self.profile.served[o][i], self.e2e[o][i]
        if tput <= 0 or not e2e > 0:  # e2e NaN: the profile does not know this cell's latency
            return None
        if self.profile.concurrency_admitted is not None:  # measured: the budget the plan counted on too
            share = 1.0 / self.profile.budget(o, i)
        else:
            share = min(1.0, 1.0 / (tput * e2e))
        return share if self.admission >= 1.0 else min(1.0, share / self.admission)

    def expected(self, sig: Signature) -> float:
        """The expected value of the SLO's metric for this signature (seconds, or seconds per token)."""
        o, i = self.cell(sig)
        e2e = self.e2e[o][i]
        ttft = self.profile.ttft[o][i] if self.profile.ttft is not None else None
        out = max(1, sig.output_tokens)
        if self.metric == "ttft":
            return ttft if ttft is not None else e2e / out  # no TTFT column: one token's share
        if self.metric == "tpot":
            if self.profile.tpot is not None and self.profile.tpot[o][i] > 0:  # measured (NaN: unknown)
                return self.profile.tpot[o][i]
            if ttft is not None and out > 1:
                return max(0.0, e2e - ttft) / (out - 1)
            return e2e / out  # holds the prefill: a long prompt with a short answer reads slow
        if self.metric == "tpat":
            return e2e / self.tokens(sig)
        return e2e

    def tokens(self, sig: Signature) -> int:
        return tokens_per(self.metric, sig.input_tokens, sig.output_tokens)

    def slack(self, sig: Signature) -> float:
        """target − expected (positive: room to spare); +inf without a target."""
        if self.target is None:
            return float("inf")
        return self.target - self.expected(sig)


def slo_metric(slos: Mapping[str, float]) -> tuple[str | None, float | None]:
    for metric in METRIC_PRECEDENCE:
        if metric in slos and slos[metric] > 0:
            return metric, float(slos[metric])
    return None, None


def deployment_model(name: str, profile: GpuProfile) -> DeploymentModel | None:
    """The deployment's load model, or None (logged) when the profile cannot give one."""
    metric, target = slo_metric(profile.slos)
    if profile.e2e is not None:
        return DeploymentModel(name, profile, profile.e2e, metric, target)
    slos = profile.slos
    if slos.get("e2e", 0) > 0:
        e2e = float(slos["e2e"])
        matrix = tuple(tuple(e2e for _ in profile.inputs) for _ in profile.outputs)
        log.warning("profile %s has no e2e table: latency estimated as its SLO target e2e=%gs", name, e2e)
        return DeploymentModel(name, profile, matrix, metric, target, estimated=True)
    per_token = next((k for k in ("tpot", "tpat") if slos.get(k, 0) > 0), None)
    if per_token is not None:
        value = float(slos[per_token])
        matrix = tuple(tuple(value * tokens_per(per_token, int(i), int(out)) for i in profile.inputs)
                       for out in profile.outputs)
        log.warning("profile %s has no e2e table: latency estimated as %s target %gs x the tokens it is per",
                    name, per_token, value)
        return DeploymentModel(name, profile, matrix, metric, target, estimated=True)
    log.warning("profile %s has no e2e table and no latency SLO to estimate one from: its pods are "
                "routed by the fallback (load-balance)", name)
    return None


def build_table(profiles: Mapping[str, GpuProfile],
                cuts: Mapping[str, float] | None = None) -> dict[str, DeploymentModel]:
    """deployment name -> load model, for the profiles that can give one; `cuts`: the optimizer's
    feedback cuts per deployment (fleet_factors.decode)."""
    out = {}
    for name, profile in profiles.items():
        m = deployment_model(name, profile)
        if m is not None:
            cut = (cuts or {}).get(name, 1.0)
            out[name] = replace(m, admission=cut) if cut < 1.0 else m
    return out

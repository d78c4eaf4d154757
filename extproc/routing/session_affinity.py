"""`session-affinity`: the requests of one session (header `x-aibrix-session-key`, AIBrix's name) go to
one pod, so its KV cache holds the conversation.

Rendezvous (highest-random-weight) hashing over the candidate pods: each (session, pod) pair gets a
deterministic hash and the highest wins. Adding or removing a pod moves only the sessions that win or
lose on it; a pod that is gone or unhealthy is not a candidate, so its sessions re-pin to their next
best pod by themselves. Every gateway replica computes the same answer without sharing anything.

The pin is a Filter, not a Scorer: blended (and a bare `session-affinity` is auto-blended with
load-balance and least-request) a scorer's vote would be outweighed as soon as the session's pod is not
the least loaded, whereas members' filters stay hard constraints. The imbalance gate still runs first,
so a pod far more loaded than the rest (the gate's rule) sheds its sessions until it recovers.
Without a session key nothing is filtered and the request is routed as load-balance routes it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from extproc.openai import Request
from extproc.routing.framework import BuildContext, PodView, Profile, register
from extproc.routing.load_balance import LoadBalanceScorer
from extproc.routing.load_math import LowestScorePicker

MAX_SESSION_KEY_BYTES = 256


def rendezvous(session: str, pod_name: str) -> int:
    digest = hashlib.blake2b(f"{session}\0{pod_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def session_pod(session: str, pods: Sequence[PodView]) -> PodView:
    """The session's pod among `pods`: the highest rendezvous weight (pod names are unique per model)."""
    return max(pods, key=lambda p: rendezvous(session, p.pod.name))


class SessionFilter:
    """Narrows the candidates to the session's pod; leaves them all when the request has no session."""

    def filter(self, request: Request, pods: Sequence[PodView], now: float) -> Sequence[PodView]:
        key = request.session_key
        if not key or len(pods) < 2:
            return pods
        return [session_pod(key, pods)]


@register("session-affinity")
def build(ctx: BuildContext) -> Profile:
    return Profile("session-affinity", LowestScorePicker(ctx.rng),
                   scorers=[(LoadBalanceScorer(ctx.settings.load_balance), 1.0)], filters=[SessionFilter()])

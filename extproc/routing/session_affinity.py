"""`session-affinity`: the requests of one session (header `x-aibrix-session-key`, AIBrix's name) go to
one pod, so its KV cache holds the conversation.

Rendezvous (highest-random-weight) hashing over the candidate pods: each (session, pod) pair gets a
deterministic hash and the highest wins. Adding or removing a pod moves only the sessions that win or
lose on it; a pod that is gone or unhealthy is not a candidate, so its sessions re-pin to their next
best pod by themselves. Every gateway replica computes the same answer without sharing anything.
Without a session key the request is routed as load-balance routes it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from extproc.openai import Request
from extproc.routing.framework import PodView, Profile, RoutingSettings, register
from extproc.routing.load_balance import LoadBalanceScorer, LowestScorePicker

SESSION_HEADER = "x-aibrix-session-key"
MAX_SESSION_KEY_BYTES = 256


def rendezvous(session: str, pod_name: str) -> int:
    digest = hashlib.blake2b(f"{session}\0{pod_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class SessionScorer:
    """1.0 for the session's pod, 0.0 for the others; NaN everywhere (no opinion) without a key."""

    def score(self, request: Request, pods: Sequence[PodView], now: float) -> list[float]:
        key = request.session_key
        if not key:
            return [float("nan")] * len(pods)
        weights = [rendezvous(key, p.pod.name) for p in pods]
        best = max(weights)
        return [1.0 if w == best else 0.0 for w in weights]


class SessionPicker:
    """Routing alone: the session's pod, or load-balance's choice when the request has no session."""

    def __init__(self, load_balance: LoadBalanceScorer, fallback: LowestScorePicker) -> None:
        self._load_balance = load_balance
        self._fallback = fallback

    def pick(self, pods: Sequence[PodView], scores: Sequence[float]) -> PodView:
        for pod, score in zip(pods, scores):
            if score == 1.0:
                return pod
        # load-balance reads only the pod views, not the request or the clock
        return self._fallback.pick(pods, self._load_balance.score(None, pods, 0.0))  # type: ignore[arg-type]


@register("session-affinity")
def build(settings: RoutingSettings) -> Profile:
    picker = SessionPicker(LoadBalanceScorer(settings.load_balance), LowestScorePicker(settings.rng()))
    return Profile("session-affinity", picker, scorers=[(SessionScorer(), 1.0)])

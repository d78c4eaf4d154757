"""The scheduling framework, after the Gateway API Inference Extension's plugin roles.

A strategy is a Profile: Filters narrow the candidates, Scorers rate each pod, a Picker chooses. Routing
alone, a strategy's picker reads its raw scores; blended (blend.py), each scorer's scores are normalised
to [0, 1] per request and weighted. Lifecycle hooks let plugins learn: `post_arrival` runs once as a
request reaches the router, `post_choice` after a pod is chosen, `post_response` when the request's
record arrives. Adding a strategy is one module that calls
`register` (with `params=` when it owns a section of `routing:`); its factory gets a typed BuildContext.
Everything here is pure: time comes in as `now`, nothing does I/O.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from extproc.openai import OpenAIError, Request
from extproc.pool.pod import Pod
from extproc.routing.ordering import best_first
from extproc.routing.outcome import Queued, Rejected, Routed
from extproc.routing.params import Params, declare
from extproc.routing.settings import RoutingSettings
from extproc.routing.store import RoutingState
from extproc.vocabulary import PodView, RequestRecord

log = logging.getLogger(__name__)


class Filter(Protocol):
    def filter(self, request: Request, pods: Sequence[PodView], now: float) -> Sequence[PodView]: ...


class Scorer(Protocol):
    """Rates every pod. Routing alone, a strategy's own Picker reads the raw scores. Blended, each
    scorer's scores are normalised per request (blend.normalize) by the direction every scorer
    declares, `lower_is_better`; NaN or ±Inf means "not scored"."""

    lower_is_better: bool  # a class attribute of every scorer: which way its raw scores point

    def score(self, request: Request, pods: Sequence[PodView], now: float) -> Sequence[float]: ...


class Picker(Protocol):
    """Chooses one pod. For the endpoint-picker protocol's fallbacks a picker may also offer
    `order(pods, scores, n) -> list[PodView]` (the first n pods, best first, as its picks would come: one
    scoring pass orders them), or, when its choice moves state of its own (round robin), `following(pods,
    chosen) -> list[PodView]`: what comes after its pick, without moving; others are asked again over
    what is left."""

    def pick(self, pods: Sequence[PodView], scores: Sequence[float]) -> PodView: ...


@runtime_checkable
class PostArrival(Protocol):
    """Told a request reached the gateway, once, before its first pick: whatever comes of it (routed,
    held in a waiting room and routed later, refused, or no pod to take it)."""

    def post_arrival(self, request: Request, now: float) -> None: ...


@runtime_checkable
class PostChoice(Protocol):
    """Told which pod a request went to (GIE's PostCycle)."""

    def post_choice(self, request: Request, chosen: PodView, now: float) -> None: ...


@runtime_checkable
class PostResponse(Protocol):
    """Told how a request ended: tokens, latency, status (GIE's PostResponse)."""

    def post_response(self, record: RequestRecord, now: float) -> None: ...


@runtime_checkable
class PostServe(Protocol):
    """Told the data plane served a request from another pod than the one chosen (a fallback of the
    endpoint-picker protocol's ordered list): what was counted on `chosen` moves to `served`."""

    def post_serve(self, request: Request, chosen: Pod, served: Pod, now: float) -> None: ...


@runtime_checkable
class PostReject(Protocol):
    """Told a request of `model` was refused (a 429: its SLO cannot be met, or the queue is full)."""

    def post_reject(self, model: str, rejected: Rejected, now: float) -> None: ...


class MaxScorePicker:
    """Highest blended score wins; ties are broken at random so equal pods share load."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, pods: Sequence[PodView], scores: Sequence[float]) -> PodView:
        best = max(scores)
        winners = [p for p, s in zip(pods, scores) if s == best]
        return winners[0] if len(winners) == 1 else self._rng.choice(winners)

    def order(self, pods: Sequence[PodView], scores: Sequence[float], n: int | None = None) -> list[PodView]:
        return best_first(pods, [-s if s == s else math.inf for s in scores], n, self._rng)


class RandomPicker:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, pods: Sequence[PodView], scores: Sequence[float]) -> PodView:
        return self._rng.choice(pods)

    def order(self, pods: Sequence[PodView], scores: Sequence[float], n: int | None = None) -> list[PodView]:
        return self._rng.sample(list(pods), len(pods) if n is None else min(n, len(pods)))


@dataclass(slots=True)
class Profile:
    """A strategy: filters narrow, scorers rate, the picker chooses.

    `exclusive` strategies (the slo* family, round-robin) manage their own pod selection: they route
    alone whatever else a header names, are never auto-blended and never narrowed by the imbalance gate.
    `hooks_of` lists plugins that learn but are not called by `pick` (a blend's member strategies)."""

    name: str
    picker: Picker
    scorers: list[tuple[Scorer, float]] = field(default_factory=list)
    filters: list[Filter] = field(default_factory=list)
    exclusive: bool = False
    hooks_of: list[object] = field(default_factory=list)

    @property
    def blendable(self) -> bool:
        """Can be one voice of a weighted blend: it scores pods and does not insist on routing alone."""
        return bool(self.scorers) and not self.exclusive

    def plugins(self) -> list[object]:
        return [*self.filters, *(s for s, _ in self.scorers), self.picker, *self.hooks_of]

    def candidates(self, request: Request, pods: Sequence[PodView], now: float) -> Sequence[PodView]:
        for f in self.filters:
            pods = f.filter(request, pods, now)
        return pods

    def totals(self, request: Request, pods: Sequence[PodView], now: float) -> list[float]:
        """Each pod's weighted score (the picker's input)."""
        scorers = self.scorers
        if len(scorers) == 1 and scorers[0][1] == 1.0:  # one scorer routing alone: its raw scores
            return list(scorers[0][0].score(request, pods, now))
        totals = [0.0] * len(pods)
        for scorer, weight in scorers:
            totals = [t + weight * s for t, s in zip(totals, scorer.score(request, pods, now))]
        return totals

    def pick(self, request: Request, pods: Sequence[PodView], now: float,
             queued: bool = False) -> PodView | Queued | Rejected | None:
        """The chosen pod; None: no candidate. A strategy that holds requests back returns Queued or
        Rejected instead (routing/outcome.py); `queued` tells it the request is leaving its queue."""
        pods = self.candidates(request, pods, now)
        if not pods:
            return None
        if len(pods) == 1:
            return pods[0]
        return self.picker.pick(pods, self.totals(request, pods, now) if self.scorers else [])

    def ranked(self, request: Request, pods: Sequence[PodView], now: float,
               n: int | None = None) -> list[PodView] | None:
        """The first `n` candidates (all: None), best first, from one scoring pass (the protocol's
        ordered fallbacks); None when the picker cannot order (a strategy that holds requests back is
        asked pod by pod instead)."""
        order = getattr(self.picker, "order", None)
        if order is None:
            return None
        pods = self.candidates(request, pods, now)
        if len(pods) < 2:
            return list(pods[:n])
        return order(pods, self.totals(request, pods, now) if self.scorers else [0.0] * len(pods), n)


class Hooks:
    """The lifecycle hooks of everything that learns: plugins of built profiles plus the gateway's own
    (in-flight counts, token tally, health, traces). Each hook object is called once per event even
    when several profiles share it."""

    def __init__(self) -> None:
        self._arrival: list[PostArrival] = []
        self._choice: list[PostChoice] = []
        self._response: list[PostResponse] = []
        self._reject: list[PostReject] = []
        self._serve: list[PostServe] = []

    def add(self, plugin: object) -> None:
        if isinstance(plugin, PostArrival) and plugin not in self._arrival:
            self._arrival.append(plugin)
        if isinstance(plugin, PostChoice) and plugin not in self._choice:
            self._choice.append(plugin)
        if isinstance(plugin, PostResponse) and plugin not in self._response:
            self._response.append(plugin)
        if isinstance(plugin, PostReject) and plugin not in self._reject:
            self._reject.append(plugin)
        if isinstance(plugin, PostServe) and plugin not in self._serve:
            self._serve.append(plugin)

    def post_arrival(self, request: Request, now: float) -> None:
        for hook in self._arrival:
            try:
                hook.post_arrival(request, now)
            except Exception:  # one plugin's bug must not cost the request or the other hooks
                log.exception("post_arrival hook %r failed", hook)

    def post_choice(self, request: Request, chosen: PodView, now: float) -> None:
        for hook in self._choice:
            try:
                hook.post_choice(request, chosen, now)
            except Exception:  # one plugin's bug must not cost the request or the other hooks
                log.exception("post_choice hook %r failed", hook)

    def post_response(self, record: RequestRecord, now: float) -> None:
        for hook in self._response:
            try:
                hook.post_response(record, now)
            except Exception:
                log.exception("post_response hook %r failed", hook)

    def post_serve(self, request: Request, chosen: Pod, served: Pod, now: float) -> None:
        for hook in self._serve:
            try:
                hook.post_serve(request, chosen, served, now)
            except Exception:
                log.exception("post_serve hook %r failed", hook)

    def post_reject(self, model: str, rejected: Rejected, now: float) -> None:
        for hook in self._reject:
            try:
                hook.post_reject(model, rejected, now)
            except Exception:
                log.exception("post_reject hook %r failed", hook)


@dataclass(slots=True, frozen=True)
class BuildContext:
    """What a strategy's factory builds from."""

    model: str                 # the model it routes for ("" when built for none in particular)
    settings: RoutingSettings  # routing as this model sees it (its load_balance, auto_blend)
    params: Any                # its own `routing.<key>` section, parsed (register(..., params=)); else None
    store: RoutingState        # learned state that outlives reloads: `store.slot(key, factory)`
    rng: random.Random         # tie-breaks: one seeded source, shared by every strategy


Factory = Callable[[BuildContext], Profile]


P = TypeVar("P")  # what the owner of a wait keeps on each held request (its payload)
R = TypeVar("R")


class WaitingRoom(Protocol):
    """Where a request its strategy held back waits: the room admits it (Queued) or refuses it
    (Rejected: the room is full). extproc.admission asks it; a Routed or no-pod outcome never gets here."""

    def admit(self, queued: Queued) -> Queued | Rejected: ...


class LiveRoom(WaitingRoom, Protocol):
    """A waiting room on a live gateway (an asyncio shell): the stream awaits its request's dispatch."""

    async def wait(self, request: Request, profile: Profile, request_id: str, queued: Queued) -> Routed: ...

    def reject(self, model: str, rejected: Rejected) -> OpenAIError:
        """The refusal counted, told to the gateway's hooks, and answered (a 429 to raise)."""
        ...


class Held(Protocol[P]):
    """A request in a waiting room as its owner sees it: the payload the owner put on it."""

    payload: P


class VirtualRoom(WaitingRoom, Protocol[P]):
    """A waiting room in virtual time (the fleet simulation), whose owner keeps a P on each request and
    drives dispatch and expiry from its own event loop."""

    def length(self, model: str) -> int: ...

    def dispatch(self, model: str, now: float, route: Callable[[Held[P]], R]) -> Sequence[tuple[Held[P], R]]:
        """Re-route the waiting requests of `model` while they fit; those that left, with `route`'s answer."""
        ...

    def expire(self, model: str, now: float) -> Sequence[tuple[Held[P], Rejected]]:
        """Those whose deadline passed by `now`, removed and refused."""
        ...


@dataclass(frozen=True, eq=False)
class Waiting:
    """What a strategy that holds requests back (its pick returns Queued or Rejected) brings with it,
    so the gateway's shells name no strategy: its waiting room, live (an asyncio shell on the gateway,
    built once per gateway and shared by every strategy registered with this same Waiting) and in
    virtual time (the pure room over its queues, for the fleet simulation), and the background loop
    that keeps its learned state fresh off the request path. Built lazily: routing does no I/O."""

    name: str                                     # names the background task: "<name>-profiles"
    live: Callable[[Any], LiveRoom]               # the gateway (server.gateway.Gateway) -> its room
    virtual: Callable[[RoutingState], VirtualRoom[Any]]  # the gateway's learned state -> the pure room
    refresh: Callable[[Any, Any], Any] | None = None  # (gateway, Redis URL or RedisTarget) -> coroutine
    # (the gateway's learned state, model) -> the model's requests waiting in this room now
    length: Callable[[RoutingState, str], int] | None = None


_REGISTRY: dict[str, tuple[Factory, Params | None]] = {}
_WAITING: dict[str, Waiting] = {}


class StrategySpecError(ValueError):
    """A `routing-strategy` value (or default_strategy) is invalid; the message names the bad part.
    The server answers it with a 400."""


class UnknownStrategy(StrategySpecError, KeyError):
    """A strategy name that is not registered."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:  # KeyError would repr() the name
        return f"unknown routing strategy {self.name!r}; valid: {', '.join(strategy_names())}"


def register(name: str, params: Params | None = None,
             waiting: Waiting | None = None) -> Callable[[Factory], Factory]:
    """Register a strategy's factory under `name`; `params`: the section of `routing:` it owns;
    `waiting`: where the requests it holds back wait (strategies sharing one Waiting share the room)."""
    if params is not None:
        declare(params)

    def add(factory: Factory) -> Factory:
        _REGISTRY[name] = (factory, params)
        if waiting is not None:
            _WAITING[name] = waiting
        return factory
    return add


def strategy_names() -> list[str]:
    return sorted(_REGISTRY)


def waiting_for(name: str) -> Waiting | None:
    """The waiting room of the strategy (or profile) `name`; None: it never holds a request back."""
    return _WAITING.get(name)


def waitings() -> list[Waiting]:
    """Every registered Waiting, once each, in registration order."""
    return list({id(w): w for w in _WAITING.values()}.values())


def held_back(state: RoutingState, model: str) -> int:
    """The model's requests held back in every waiting room now (a trace's meta_queueing_reqs)."""
    return sum(w.length(state, model) for w in waitings() if w.length is not None)


def build(name: str, settings: RoutingSettings | None = None, store: RoutingState | None = None,
          model: str = "") -> Profile:
    """The strategy `name` for `model`. Without a `store`, it learns into a fresh one of its own."""
    try:
        factory, params = _REGISTRY[name]
    except KeyError:
        raise UnknownStrategy(name) from None
    settings = settings or RoutingSettings()
    if store is None:
        store = RoutingState.seeded(settings.seed)
    own = None
    if params is not None:
        own = settings.params.get(params.key)
        if own is None:  # settings made in code, not parsed: the section's defaults
            own = params.parse(None)
    return factory(BuildContext(model, settings, own, store, store.rng))

"""Weighted strategy blends: the `routing-strategy` value, per-request normalisation, AIBrix's auto-blend.

    routing-strategy: prefix-cache:5,load-balance:4

Integer weights 0 … 1,000,000 (default 1); `:0` drops a strategy; all zero is an error. Blended, each
scorer's scores are normalised per request (robustly, see `normalize`) and weighted by weight / sum, and
the highest total wins; exact ties go to a random one of them, never to "first by name", which would
pile every tie onto one pod.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from extproc.openai import Request
from extproc.routing.framework import (
    MaxScorePicker,
    PodView,
    Profile,
    Scorer,
    StrategySpecError,
    UnknownStrategy,
)
from extproc.routing.settings import MAX_WEIGHT, AutoBlendSettings

LOAD_BALANCE, LEAST_REQUEST, PREFIX_CACHE = "load-balance", "least-request", "prefix-cache"
MAX_SPEC_CHARS = 512   # a header value longer than this is refused before it is parsed
MAD_CLIP = 3.0         # clip to median ± 3 median absolute deviations ("extreme outlier")


@dataclass(slots=True, frozen=True)
class StrategySpec:
    """A parsed `routing-strategy` value: strategies with weight > 0, in the order given."""

    items: tuple[tuple[str, int], ...]
    mentioned: frozenset[str]  # every name written, `:0` ones included: those are never re-added

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.items)

    @property
    def weighted(self) -> str:
        """The strategies with weights, as a header would name them (a lone strategy without one)."""
        if len(self.items) == 1:
            return self.items[0][0]
        return ",".join(f"{n}:{w}" for n, w in self.items)

    @property
    def text(self) -> str:
        """Canonical form, `:0` names included since they change auto-blend: the cache key."""
        zeros = sorted(self.mentioned - set(self.names))
        return ",".join([self.weighted, *(f"{n}:0" for n in zeros)])

    @property
    def label(self) -> str:
        """Strategy names without weights: a bounded metric label (clients choose the weights)."""
        return ",".join(sorted(self.names))


def parse_spec(value: str, known: Callable[[str], bool]) -> StrategySpec:
    """Parse a header value; raise StrategySpecError naming the bad part (UnknownStrategy for a name
    that is not registered)."""
    text = value.strip().lower()
    if not text:
        raise StrategySpecError("routing strategy is empty")
    if len(text) > MAX_SPEC_CHARS:
        raise StrategySpecError(f"routing strategy is longer than {MAX_SPEC_CHARS} characters")
    items: list[tuple[str, int]] = []
    mentioned: set[str] = set()
    for part in text.split(","):
        name, sep, weight_text = (x.strip() for x in part.partition(":"))
        if not name:
            raise StrategySpecError(f"empty strategy name in {value.strip()!r}")
        weight = 1
        if sep:
            if not weight_text.isascii() or not weight_text.isdigit():
                raise StrategySpecError(f"weight {weight_text!r} of {name!r} is not an integer from 0 to "
                                        f"{MAX_WEIGHT}")
            weight = int(weight_text)
            if weight > MAX_WEIGHT:
                raise StrategySpecError(f"weight {weight} of {name!r} is above {MAX_WEIGHT}")
        if not known(name):
            raise UnknownStrategy(name)
        if name in mentioned:
            raise StrategySpecError(f"strategy {name!r} is named twice")
        mentioned.add(name)
        if weight:
            items.append((name, weight))
    if not items:
        raise StrategySpecError(f"every strategy in {value.strip()!r} has weight 0")
    return StrategySpec(tuple(items), frozenset(mentioned))


def auto_blend(spec: StrategySpec, weights: AutoBlendSettings,
               blendable: Callable[[str], bool]) -> StrategySpec:
    """AIBrix's silent blend: capacity awareness behind whatever strategy was asked for.

    * `,load-balance:W` is appended (W = load_balance_weight; 0 turns the whole feature off, as in
      AIBrix), and `,least-request:W` (least_request_weight) unless prefix-cache is present;
    * a bare `prefix-cache` becomes `prefix-cache:5,load-balance:4` (its own two weights);
    * a strategy the caller named, even with `:0`, is never added again;
    * exclusive or non-scoring strategies (random) and a plain `load-balance` are left alone, and so is
      a spec the additions would collapse to a single strategy (it routes as asked).
    """
    if weights.load_balance_weight <= 0:
        return spec
    names = spec.names
    if not all(blendable(n) for n in names) or names == (LOAD_BALANCE,):
        return spec
    has_prefix = PREFIX_CACHE in names
    items = list(spec.items)
    if LOAD_BALANCE not in spec.mentioned:
        if names == (PREFIX_CACHE,):
            items = [(PREFIX_CACHE, weights.prefix_cache_weight),
                     (LOAD_BALANCE, weights.prefix_cache_load_balance_weight)]
        else:
            items.append((LOAD_BALANCE, weights.load_balance_weight))
    if not has_prefix and LEAST_REQUEST not in spec.mentioned and weights.least_request_weight > 0:
        items.append((LEAST_REQUEST, weights.least_request_weight))
    items = [(n, w) for n, w in items if w > 0]
    if len(items) <= 1 or tuple(items) == spec.items:
        return spec
    return StrategySpec(tuple(items), spec.mentioned | {n for n, _ in items})


def normalize(scores: Sequence[float], lower_is_better: bool) -> list[float]:
    """Scores mapped to [0, 1], higher better, robust to one outlier stretching the scale.

    With three or more finite scores, clip to median ± 3 MAD first; then min–max (inverted when lower
    is better). All equal → 1.0. Non-finite (unscored, or load-balance's +Inf) → 0, the worst: a strong
    penalty, not an exclusion.
    """
    total = sum(scores)
    if total - total == 0:  # every score finite (inf - inf and NaN are NaN): checked at C speed
        finite = list(scores)
    else:
        finite = [s for s in scores if -math.inf < s < math.inf]  # drops NaN too
    if not finite:
        return [0.0] * len(scores)
    low, high = min(finite), max(finite)
    if len(finite) >= 3 and low != high:
        ordered = sorted(finite)
        median = _median(ordered)
        mad = _median(sorted([abs(s - median) for s in ordered]))
        if mad > 0 and (low < median - MAD_CLIP * mad or high > median + MAD_CLIP * mad):
            low, high = max(low, median - MAD_CLIP * mad), min(high, median + MAD_CLIP * mad)
            finite = [low if s < low else high if s > high else s for s in finite]
    if low == high:
        return [1.0 if -math.inf < s < math.inf else 0.0 for s in scores]
    scale = 1.0 / (high - low)
    if lower_is_better:
        out = [(high - s) * scale for s in finite]
    else:
        out = [(s - low) * scale for s in finite]
    if len(finite) == len(scores):  # the common case: every pod scored
        return out
    it = iter(out)
    return [next(it) if -math.inf < s < math.inf else 0.0 for s in scores]


def _median(ordered: Sequence[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class Normalized:
    """A member strategy's scorer as one voice of a blend: its scores normalised per request."""

    __slots__ = ("inner", "_lower")
    lower_is_better = False  # normalised: higher is better

    def __init__(self, inner: Scorer) -> None:
        self.inner = inner
        self._lower = inner.lower_is_better

    def score(self, request: Request, pods: Sequence[PodView], now: float) -> list[float]:
        return normalize(self.inner.score(request, pods, now), self._lower)


def compose(name: str, members: Sequence[tuple[Profile, int]], rng: random.Random) -> Profile:
    """One Profile blending member strategies. A member's weight is shared among its own scorers in
    proportion to theirs; members' filters still apply (hard constraints); their pickers do not."""
    for member, _ in members:
        if not member.blendable:
            raise StrategySpecError(f"{member.name!r} cannot be blended: it "
                                    f"{'routes alone' if member.exclusive else 'does not score pods'}")
    total = sum(w for _, w in members)
    scorers: list[tuple[Scorer, float]] = []
    for member, weight in members:
        own = sum(w for _, w in member.scorers) or 1.0
        scorers += [(Normalized(s), weight / total * w / own) for s, w in member.scorers]
    return Profile(name, MaxScorePicker(rng), scorers=scorers,
                   filters=[f for member, _ in members for f in member.filters],
                   hooks_of=[p for member, _ in members for p in member.plugins()
                             if p not in member.filters])

"""The Router: `routing-strategy` header values compiled into Profiles, per model, cached and bounded.

The gateway keeps one Router per config and one RoutingState for its lifetime:

    router = Router(config.routing_settings, state)          # on start and on every reload
    spec = router.parse(header_value)                          # request headers: StrategySpecError -> 400
    profile = router.profile_for(spec, request.model)          # request body: a ready Profile
    chosen = profile.pick(request, views, now)

A compiled profile is: the imbalance gate (unless the strategy is exclusive), then the strategy alone or
the blend of its members after auto-blend. Member strategies are built once per (name, model) and shared
by every blend that names them, so a strategy's learning hooks see every request it took part in.
Clients choose header values, so the caches are bounded (settings.cache_size, oldest dropped first).

A member's learning hooks join (`on_plugin`) when a profile that routes by it is first compiled, not
when it is built: validation builds every registered strategy, and a gateway must not pay, on every
request, for learners of strategies no request has asked for. From then on they see every request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

from extproc.routing.blend import StrategySpec, auto_blend, compose, parse_spec
from extproc.routing.framework import Profile, StrategySpecError, build, strategy_names
from extproc.routing.gate import ImbalanceGate
from extproc.routing.settings import RoutingSettings
from extproc.routing.store import RoutingState


class Router:
    def __init__(self, settings: RoutingSettings | None = None, state: RoutingState | None = None,
                 on_plugin: Callable[[object], None] | None = None,
                 active: set[tuple[str, str]] | None = None) -> None:
        self.settings = settings or RoutingSettings()
        self.state = state if state is not None else RoutingState.seeded(self.settings.seed)
        # Told about every plugin of a member strategy once a profile routes by it (the gateway's
        # Hooks.add).
        self.on_plugin = on_plugin
        self._active: set[tuple[str, str]] = set(active or ())  # (name, model) of members that route
        self._specs: dict[str, StrategySpec] = {}
        self._members: dict[tuple[str, str], Profile] = {}
        self._compiled: dict[tuple[str, str], Profile] = {}
        self._known = frozenset(strategy_names())
        self.default = parse_spec(self.settings.default_strategy, self._known.__contains__)

    def reconfigured(self, settings: RoutingSettings) -> Router:
        """A Router for a new config that keeps this one's learned state, hook callback, and the
        strategies requests have used (their learners keep learning)."""
        return Router(settings, self.state, self.on_plugin, self._active)

    # -- the request path --------------------------------------------------------------------------

    def parse(self, value: str | None) -> StrategySpec:
        """The header value (None or blank: the default strategy) parsed; raises StrategySpecError."""
        if value is None or not value.strip():
            return self.default
        spec = self._specs.get(value)
        if spec is None:
            spec = parse_spec(value, self._known.__contains__)
            _put(self._specs, value, spec, self.settings.cache_size)
        return spec

    def profile_for(self, spec: StrategySpec | str | None, model: str) -> Profile:
        """The Profile routing `spec` for `model`; its name is `spec.label` (bounded, weights left out)."""
        if not isinstance(spec, StrategySpec):
            spec = self.parse(spec)
        key = (spec.text, model)
        profile = self._compiled.get(key)
        if profile is None:
            profile = self._compile(spec, model)
            _put(self._compiled, key, profile, self.settings.cache_size)
        return profile

    @property
    def imbalance_total(self) -> dict[str, int]:
        """Gate firings per model since start (survives reloads): `extproc_load_imbalance_total{model}`."""
        return self.state.imbalance_total

    # -- building ----------------------------------------------------------------------------------

    def member(self, name: str, model: str) -> Profile:
        """One registered strategy as built for `model` (cached for the life of this Router)."""
        key = (name, model)
        profile = self._members.get(key)
        if profile is None:
            profile = self._members[key] = build(name, self.settings.for_model(model), self.state, model)
        return profile

    def _activate(self, names: tuple[str, ...], model: str) -> None:
        """These members route requests from now on: their learners join the hooks."""
        for name in names:
            key = (name, model)
            if key not in self._active:
                self._active.add(key)
                if self.on_plugin is not None:
                    for plugin in self.member(name, model).plugins():
                        self.on_plugin(plugin)

    def plugins(self) -> Iterator[object]:
        """Every plugin of every member a profile routes by (for rebuilding the gateway's hooks)."""
        for key, profile in self._members.items():
            if key in self._active:
                yield from profile.plugins()

    def resolve(self, spec: StrategySpec, model: str) -> StrategySpec:
        """What `spec` routes as for `model`: an exclusive strategy alone, else the auto-blended spec."""
        members = [self.member(name, model) for name in spec.names]
        exclusive = next((m for m in members if m.exclusive), None)
        if exclusive is not None:  # routes alone, whatever else was named (as AIBrix does)
            return StrategySpec(((exclusive.name, 1),), frozenset({exclusive.name}))
        return auto_blend(spec, self.settings.for_model(model).auto_blend,
                          lambda name: self.member(name, model).blendable)

    def _compile(self, spec: StrategySpec, model: str) -> Profile:
        routed = self.resolve(spec, model)
        self._activate(routed.names, model)
        if len(routed.items) == 1:
            alone = self.member(routed.items[0][0], model)
            if alone.exclusive:  # manages its own pod selection: no gate
                return replace(alone, name=spec.label)
            gate = self._gate(model)
            return replace(alone, name=spec.label, filters=[gate, *alone.filters])
        profile = compose(spec.label, [(self.member(n, model), w) for n, w in routed.items], self.state.rng)
        profile.filters.insert(0, self._gate(model))
        return profile

    def _gate(self, model: str) -> ImbalanceGate:
        return ImbalanceGate(self.settings.for_model(model).load_balance, self.state.imbalance_total)

    def validate(self, models: tuple[str, ...] | list[str]) -> None:
        """Build the default strategy and every registered one for each model; raise StrategySpecError
        (or whatever a factory raises) now, at config load, rather than on a request."""
        for model in (*models, ""):
            for name in self._known:
                self.member(name, model)
            self.profile_for(self.default, model)


def _put(cache: dict, key: object, value: object, limit: int) -> None:
    if len(cache) >= limit:
        del cache[next(iter(cache))]  # oldest first: cheap, and enough against header-value churn
    cache[key] = value


__all__ = ["Router", "StrategySpec", "StrategySpecError"]

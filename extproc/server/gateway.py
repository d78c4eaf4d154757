"""The gateway's live state: config, pool, in-flight counts, strategies and request metrics."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics

from extproc.config import DEFAULT_DESTINATION_HEADER, Config, ConfigError
from extproc.openai import Request
from extproc.pool import Pod, Pool
from extproc.routing import PodView, Profile, RoutingSettings, build
from extproc.state.inflight import InFlight

# Headers that steer Envoy's ORIGINAL_DST or AIBrix-style gateways: never accepted from clients.
CLIENT_FORBIDDEN_HEADERS = frozenset({DEFAULT_DESTINATION_HEADER, "target-pod", "x-envoy-original-dst-host"})

disable_created_metrics()  # *_created series double the scrape for no routing value


class Gateway:
    def __init__(self, config: Config, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.clock = clock
        self.inflight = InFlight(self.registry)
        self.requests_total = Counter("extproc_requests", "Requests handled, by outcome",
                                      ["model", "pod", "strategy", "code"], registry=self.registry)
        self.open_streams = 0
        # Envoy's bootstrap names the header ORIGINAL_DST follows; changing only ours on a reload would
        # let clients set the one Envoy still follows.
        self._destination_header = config.destination_header
        self.apply(config)

    def apply(self, config: Config) -> None:
        """Swap in a new config. In-flight tickets keep their own pod keys, so nothing is lost."""
        if config.destination_header != self._destination_header:
            raise ConfigError("destination_header cannot change without a restart "
                              f"(Envoy follows {self._destination_header!r})")
        self.pool = Pool(config.pods, config.models)
        self.inflight.retain(p.key for p in config.pods)
        self.config = config
        self.client_forbidden_headers = sorted(CLIENT_FORBIDDEN_HEADERS | {config.destination_header})
        self._profiles: dict[str, Profile] = {}

    def profile(self, name: str) -> Profile:
        """The strategy's Profile, built once per config; raises UnknownStrategy."""
        profile = self._profiles.get(name)
        if profile is None:
            profile = self._profiles[name] = build(name, RoutingSettings(
                seed=self.config.routing.get("seed")))
        return profile

    def choose(self, request: Request, profile: Profile) -> Pod | None:
        pods = self.pool.ready_pods(request.model)
        if not pods:
            return None
        running = self.inflight.running
        chosen = profile.pick(request, [PodView(p, running(p)) for p in pods], self.clock())
        return chosen.pod if chosen is not None else None

"""The live SLO state's background refresh, off every request's path: each model's GPU profiles (files
named in `routing.slo.profiles`, Redis `aibrix:profile_*`, through extproc.gpu_profiles' store) and the
`slo` rule's split of shapes over GPU types (an LP, in a thread). The fleet simulation sets its profiles
itself (fleetsim/slo_profiles.py) and lets the split be solved in place.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from extproc.cancellation import raise_if_cancelled
from extproc.gpu_profiles import ProfileStore
from extproc.pool.pod import deployment_of
from extproc.redis_connect import RedisTarget
from extproc.slo.assignment import assign
from extproc.slo.fleet_factors import decode, factors_key
from extproc.slo.state import SloState, learned

log = logging.getLogger(__name__)


class Fleet(Protocol):
    """What the refresh reads of the gateway (extproc.server.gateway.Gateway): its pods, strategies' state
    and clock."""

    clock: Callable[[], float]
    router: Any
    pool: Any


class SloRefresh:
    def __init__(self, gateway: Fleet) -> None:
        self._gw = gateway

    @property
    def state(self) -> SloState | None:
        router = self._gw.router
        return learned(router.state.store) if router is not None else None

    async def run_profiles(self, redis: RedisTarget | str | None) -> None:
        """Every profile_refresh_seconds: profile files named in config, and Redis `aibrix:profile_*`."""
        store = ProfileStore()
        client = None
        if redis:
            from extproc import redis_connect
            client = redis_connect.open_async(redis, timeout=2)
        try:
            while True:
                try:
                    await self.refresh_profiles(store, client)
                except Exception:
                    log.exception("SLO profile refresh failed")
                try:
                    await self.refresh_splits()
                except Exception:
                    log.exception("SLO split refresh failed")
                state = self.state
                raise_if_cancelled()  # redis-py's wait_for can swallow a cancel (extproc/cancellation.py)
                await asyncio.sleep(state.settings.profile_refresh_seconds if state else 10.0)
        finally:
            if client is not None:
                await client.aclose()

    async def refresh_splits(self) -> None:
        """`slo`'s GPU types per shape (an LP of a few ms) for every model with recent arrivals, in a
        thread: never on a request's path."""
        state = self.state
        if state is None:
            return
        state.split.elsewhere = True
        for model, mix in list(state.split.mixes.items()):
            pods: dict[str, int] = {}
            for pod in self._gw.pool.ready_pods(model):
                pods[deployment_of(pod)] = pods.get(deployment_of(pod), 0) + 1
            now = self._gw.clock()
            rates, table = mix.rates(now), state.table(model)  # snapshots, taken on the loop
            split = await asyncio.to_thread(assign, table, pods, rates)
            state.split.store(model, tuple(sorted(pods.items())), now, split)

    async def refresh_cuts(self, state: SloState, client: Any, models: Iterable[str]) -> None:
        """The GPU optimizer's feedback cuts per model (slo/fleet_factors.py); Redis down: keep them (the
        key's expiry is what ends a stopped optimizer's cuts, not a gateway's lost connection)."""
        for model in models:
            try:
                raw = await asyncio.wait_for(client.get(factors_key(model)), timeout=5)
            except Exception as exc:
                log.warning("the optimizer's SLO cuts from Redis unavailable: %s", exc)
                return
            state.set_cuts(model, decode(raw))

    async def refresh_profiles(self, store: ProfileStore, client: Any = None) -> None:
        state = self.state
        if state is None:
            return
        store.load_files(state.settings.profiles)
        models = self._gw.pool.models()
        if client is not None:
            deployments: dict[str, set[str]] = {model: set() for model in models}
            for pod in self._gw.pool.all_pods():
                deployments.setdefault(pod.model, set()).add(deployment_of(pod))
            try:
                await asyncio.wait_for(store.refresh_redis(client, deployments), timeout=5)
            except Exception as exc:  # Redis down: keep what we have
                log.warning("SLO profiles from Redis unavailable: %s", exc)
            await self.refresh_cuts(state, client, models)
        for model in models:
            found = {}
            for pod in self._gw.pool.all_pods():
                if pod.model != model:
                    continue
                dep = deployment_of(pod)
                if dep and dep not in found:
                    p = store.profile_for(model, pod.namespace, dep)
                    if p is not None:
                        found[dep] = p
            state.set_profiles(model, found)

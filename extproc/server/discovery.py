"""Kubernetes discovery wired into `extproc serve` (labelled pods, or an InferencePool's): the watched
pods joined with the config file's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from extproc.config import Config
from extproc.pool.inferencepool import InferencePoolDiscovery
from extproc.pool.pod import Pod
from extproc.pool.watch import PodWatcher

log = logging.getLogger(__name__)


class DiscoveredPool:
    """Joins the config file with the watched pods: the gateway's config is always the file's config
    with the discovered pods (and their models) added, whichever of the two changed last."""

    def __init__(self, apply: Callable[[Config], None], base: Config) -> None:
        self._apply = apply
        self.base = base
        self.pods: list[Pod] = []

    def overlay(self, config: Config) -> Config:
        self.base = config
        return self._merged()

    def _merged(self) -> Config:
        pool = self.base.discovery.inferencepool
        named = (pool.model,) if pool is not None and pool.model else ()  # known with no pods: 503, not 404
        models = tuple(dict.fromkeys([*self.base.models, *named, *sorted({p.model for p in self.pods})]))
        return replace(self.base, pods=(*self.base.pods, *self.pods), models=models)

    def update(self, pods: list[Pod]) -> None:
        self.pods = sorted(pods, key=lambda p: (p.model, p.namespace, p.name))
        self._apply(self._merged())


def start_discovery(gateway: Any, config: Config) -> tuple[asyncio.Task | None, Callable[[Config], Config]]:
    """For `extproc serve`: the watch task (None with static discovery) and the overlay a config reload
    goes through, so a reloaded file keeps the discovered pods. Discovery settings take a restart."""
    if not config.discovery.enabled:
        return None, lambda c: c
    joined = DiscoveredPool(gateway.apply, config)
    settings = config.discovery
    if settings.inferencepool is not None:
        pool = settings.inferencepool
        log.info("discovering the pods of InferencePool %s/%s", pool.namespace, pool.name)
        runner = InferencePoolDiscovery(settings, joined.update).run()
    else:
        log.info("discovering pods labelled %s in %s", settings.label_selector,
                 settings.namespace or "all namespaces")
        runner = PodWatcher(settings, joined.update).run()
    return asyncio.create_task(runner, name="discovery"), joined.overlay

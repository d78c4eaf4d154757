"""Deployment discovery from the Kubernetes API, as AIBrix's optimizer finds what to plan for.

Deployments labelled `model.aibrix.ai/name` in the configured namespaces (all when none are named) are
listed and watched (`pool.watch.ListWatcher`: a resumed watch, a relist after 410 or a disconnect); the
label names the model, `model.aibrix.ai/min_replicas` the floor and `spec.replicas` the count reported
before the first plan. The service asks for the list every re-plan, so a Deployment that appears or
goes is planned for or dropped within one. A Deployment with a label that does not parse is left out
and logged, naming the label. `read` is the single GET that `POST /monitor` makes, as AIBrix's does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

from extproc.optimizer.autoscalers import WATCHERS, Cap, capped
from extproc.optimizer.deployments import (
    ConfigError,
    Deployment,
    DeploymentSource,
    KubernetesSettings,
    parse_deployment,
)
from extproc.pool.convert import as_map
from extproc.pool.watch import ListWatcher

log = logging.getLogger(__name__)

READ_TIMEOUT_SECONDS = 5.0


def deployment_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What parse_deployment reads, from a Deployment object."""
    meta = as_map(obj.get("metadata"))
    return {"name": meta.get("name"), "namespace": meta.get("namespace") or "default",
            "labels": as_map(meta.get("labels")), "replicas": as_map(obj.get("spec")).get("replicas")}


def deployment_from_object(obj: Mapping[str, Any]) -> Deployment | None:
    """What the optimizer plans for; None (logged, naming the label) for labels that do not parse."""
    fields = deployment_fields(obj)
    where = f"Deployment {fields['namespace']}/{fields['name']}"
    try:
        return parse_deployment(fields, where)
    except ConfigError as e:
        log.warning("%s not planned for: %s", where, e)
        return None


class DeploymentWatcher(ListWatcher[Deployment]):
    kind = "deployment"

    def _api_class(self, client: Any) -> Any:
        return client.AppsV1Api

    def _call(self, api: Any, **kwargs: Any) -> Any:
        kwargs.update(label_selector=self.settings.label_selector, _preload_content=False)
        if self.settings.namespace:
            return api.list_namespaced_deployment(self.settings.namespace, **kwargs)
        return api.list_deployment_for_all_namespaces(**kwargs)

    def _convert(self, obj: Mapping[str, Any]) -> Deployment | None:
        return deployment_from_object(obj)


class KubernetesDeploymentSource:
    """One watcher per namespace (or one for all); run `run()` as a supervised task."""

    def __init__(self, settings: KubernetesSettings, configuration: Any = None) -> None:
        self.settings = settings
        # configuration: a kubernetes_asyncio Configuration (tests); None: loaded from the settings
        self.watchers = [DeploymentWatcher(settings.discovery(ns), lambda _: None, configuration)
                         for ns in settings.namespaces or (None,)]
        # the autoscalers' maxReplicas (optimizer/autoscalers.py), when the config names their kinds
        self.autoscalers = [WATCHERS[kind](settings.discovery(ns), lambda _: None, configuration)
                            for kind in settings.autoscalers for ns in settings.namespaces or (None,)]

    async def run(self) -> None:
        await asyncio.gather(*(w.run() for w in [*self.watchers, *self.autoscalers]))

    @property
    def synced(self) -> bool:
        return all(w.synced.is_set() for w in [*self.watchers, *self.autoscalers])

    def caps(self) -> list[Cap]:
        return [c for w in self.autoscalers for c in w.items()]

    async def deployments(self) -> list[Deployment]:
        return capped([d for w in self.watchers for d in w.items()], self.caps())

    async def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Deployment's fields for parse_deployment, or None when it does not exist (404)."""
        if self.settings.namespaces and namespace not in self.settings.namespaces:
            return None  # outside what the optimizer may read (and its RBAC)
        api = await self.watchers[0].connect()
        try:
            response = await api.read_namespaced_deployment(
                name, namespace, _preload_content=False, _request_timeout=READ_TIMEOUT_SECONDS)
            async with response:
                body = await response.read()
                if response.status == 404:
                    return None
                if response.status != 200:
                    raise RuntimeError(f"deployment read: HTTP {response.status}: {body[:200]!r}")
            return deployment_fields(json.loads(body))
        finally:
            await api.api_client.close()


class MergedDeploymentSource:
    """The config file's deployments and the discovered ones; the file's entry wins for the same key."""

    def __init__(self, first: DeploymentSource, second: KubernetesDeploymentSource) -> None:
        self.first, self.second = first, second

    async def deployments(self) -> list[Deployment]:
        listed = {d.key: d for d in await self.second.deployments()}
        listed.update({d.key: d for d in await self.first.deployments()})
        return capped(listed.values(), self.second.caps())  # a listed one is capped by its autoscaler too

    async def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.second.read(namespace, name)

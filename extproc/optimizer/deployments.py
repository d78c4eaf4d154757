"""Which deployments (one per GPU type) serve which model: the optimizer's view of the fleet.

A `DeploymentSource` lists them. The YAML file source is here; the Kubernetes source (Deployments labelled
`model.aibrix.ai/name`, minimum from `model.aibrix.ai/min_replicas`) is in optimizer/kubernetes.py.

    profiles: [a100.json, a40.json]     # optional profile files, relative to this file
    kubernetes:                         # optional: discover Deployments (optimizer/kubernetes.py)
      namespaces: [default]             # default: every namespace
    deployments:                        # optional when discovering; these win over discovered ones
      - name: llama2-7b-a100            # the profile's "gpu" is this name
        namespace: default              # default "default"
        model: llama2-7b                # or labels: {model.aibrix.ai/name: llama2-7b}
        min_replicas: 1                 # or labels: {model.aibrix.ai/min_replicas: "1"}; kept when idle
        replicas: 2                     # optional: reported before the first plan (AIBrix: spec.replicas)
        max_replicas: 8                 # optional: the most the plan may count on (its autoscaler's
                                        # maxReplicas); or labels: {model.aibrix.ai/max_replicas: "8"}
    planning:                           # optional: the plan's constants (optimizer/policy.py), read at start
      headroom: 0.5
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import yaml

from extproc.config.source import DuplicateKey, line_of, read_yaml
from extproc.gpu_profiles import deployment_key
from extproc.optimizer.config_errors import ConfigError, check_keys
from extproc.optimizer.policy import PlanPolicy, parse_policy
from extproc.pool.pod import MODEL_LABEL
from extproc.pool.settings import DiscoverySettings

log = logging.getLogger(__name__)

MIN_REPLICAS_LABEL = "model.aibrix.ai/min_replicas"
# the kinds whose maxReplicas caps a Deployment's plan (HorizontalPodAutoscaler, AIBrix's PodAutoscaler)
AUTOSCALER_KINDS = ("hpa", "podautoscaler")
TOP_KEYS = frozenset({"deployments", "profiles", "kubernetes", "planning"})
MAX_REPLICAS_LABEL = "model.aibrix.ai/max_replicas"  # ours: the most the plan may count on


@dataclass(frozen=True, slots=True)
class Deployment:
    namespace: str
    name: str
    model: str
    min_replicas: int = 0
    replicas: int | None = None  # the count before any plan; None: min_replicas
    max_replicas: int | None = None  # the most the plan may count on (its autoscaler's maxReplicas)

    @property
    def key(self) -> str:
        return deployment_key(self.namespace, self.name)


class DeploymentSource(Protocol):
    """Lists the deployments to optimise. Called every re-plan; must be cheap when nothing changed."""

    async def deployments(self) -> list[Deployment]: ...


@runtime_checkable
class CheckedSource(DeploymentSource, Protocol):
    """A source that can tell whether a deployment exists (Kubernetes): POST /monitor asks it, as AIBrix
    does."""

    async def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The deployment's fields for parse_deployment, or None when it does not exist."""
        ...


@dataclass(frozen=True, slots=True)
class KubernetesSettings:
    """The optimizer config's `kubernetes:` section."""

    namespaces: tuple[str, ...] = ()  # empty: every namespace
    kubeconfig: str | None = None  # None: the service account in a pod, else ~/.kube/config
    label_selector: str = MODEL_LABEL
    autoscalers: tuple[str, ...] = ()  # read maxReplicas from these kinds (optimizer/autoscalers.py)
    in_cluster: bool = field(default=False, compare=False)  # from KUBERNETES_SERVICE_HOST, not the file

    def discovery(self, namespace: str | None) -> DiscoverySettings:
        return DiscoverySettings(kind="kubernetes", namespace=namespace, kubeconfig=self.kubeconfig,
                                 label_selector=self.label_selector, in_cluster=self.in_cluster)


def parse_kubernetes(data: Any) -> KubernetesSettings | None:
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise ConfigError("kubernetes: expected a mapping (namespaces, kubeconfig, label_selector)")
    check_keys("kubernetes", data, frozenset({"namespaces", "kubeconfig", "label_selector", "autoscalers"}))
    namespaces = data.get("namespaces") or []
    if not isinstance(namespaces, list) or not all(isinstance(n, str) and n and "/" not in n
                                                   for n in namespaces):
        raise ConfigError("kubernetes.namespaces: expected a list of namespace names")
    for key in ("kubeconfig", "label_selector"):
        if data.get(key) is not None and (not isinstance(data[key], str) or not data[key]):
            raise ConfigError(f"kubernetes.{key}: expected a non-empty string")
    selector = data.get("label_selector") or MODEL_LABEL
    if MODEL_LABEL not in selector.replace(" ", "").split(","):
        raise ConfigError(f"kubernetes.label_selector: must select {MODEL_LABEL} (it names the model)")
    kinds = data.get("autoscalers") or []
    if not isinstance(kinds, list) or not all(k in AUTOSCALER_KINDS for k in kinds):
        raise ConfigError(f"kubernetes.autoscalers{line_of(data, 'autoscalers')}: expected a list of "
                          f"{', '.join(AUTOSCALER_KINDS)}, got {kinds!r}")
    return KubernetesSettings(tuple(dict.fromkeys(namespaces)), data.get("kubeconfig"), selector,
                              tuple(dict.fromkeys(kinds)))


@dataclass(frozen=True, slots=True)
class OptimizerConfig:
    deployments: tuple[Deployment, ...]
    profiles: tuple[Path, ...]
    kubernetes: KubernetesSettings | None = None  # discovery on (optimizer/kubernetes.py)
    policy: PlanPolicy = field(default_factory=PlanPolicy)  # the `planning:` section


def _count(value: Any, where: str) -> int:
    """A whole number >= 0 (a label's string too); `where` names the key and its line."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)  # Kubernetes labels are strings
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: expected a whole number ≥ 0, got {value!r}")
    return value


def parse_deployment(data: Any, where: str) -> Deployment:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    labels = data.get("labels") or {}
    if not isinstance(labels, Mapping):
        raise ConfigError(f"{where}.labels: expected a mapping")
    name, namespace = data.get("name"), data.get("namespace", "default")
    model = data.get("model", labels.get(MODEL_LABEL))
    for key, value in (("name", name), ("namespace", namespace), ("model", model)):
        if not isinstance(value, str) or not value or "/" in value:
            raise ConfigError(f"{where}.{key}: expected a non-empty name without '/', got {value!r}")
    minimum = _count(data.get("min_replicas", labels.get(MIN_REPLICAS_LABEL, 0)),
                     f"{where}.min_replicas{line_of(data, 'min_replicas')}")
    replicas = data.get("replicas")
    most = data.get("max_replicas", labels.get(MAX_REPLICAS_LABEL))
    at = f"{where}.max_replicas{line_of(data, 'max_replicas')}"
    most = None if most is None else _count(most, at)
    if most is not None and most < minimum:
        raise ConfigError(f"{at}: {most} is below min_replicas {minimum}")
    return Deployment(namespace=namespace, name=name, model=model, min_replicas=minimum,
                      replicas=None if replicas is None else _count(replicas, f"{where}.replicas"),
                      max_replicas=most)


def parse_config(data: Any, base: Path) -> OptimizerConfig:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError("config: expected a mapping with 'deployments'")
    check_keys("", data, TOP_KEYS)
    planning = data.get("planning")
    if planning is not None and not isinstance(planning, Mapping):
        raise ConfigError(f"planning{line_of(data, 'planning')}: expected a mapping")
    policy = parse_policy(planning or {}, "planning")
    raw = data.get("deployments")
    raw = [] if raw is None else raw
    if not isinstance(raw, list):
        raise ConfigError("deployments: expected a list")
    deployments = tuple(parse_deployment(d, f"deployments[{k}]") for k, d in enumerate(raw))
    keys = [d.key for d in deployments]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ConfigError(f"deployments: listed twice: {dupes}")
    profiles = data.get("profiles")
    profiles = [] if profiles is None else profiles
    if not isinstance(profiles, list) or not all(isinstance(p, str) for p in profiles):
        raise ConfigError("profiles: expected a list of file paths")
    return OptimizerConfig(deployments, tuple(base / p for p in profiles),
                           parse_kubernetes(data.get("kubernetes")), policy)


def load_config(path: str | Path) -> OptimizerConfig:
    path = Path(path)
    try:
        data = read_yaml(path.read_text())  # keys remember their lines; a repeated key is refused
    except (OSError, yaml.YAMLError, DuplicateKey) as e:
        raise ConfigError(f"{path}: {e}") from e
    try:
        return parse_config(data, path.parent)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e


class FileDeploymentSource:
    """The config file's deployments, re-read when the file changes. A bad edit is logged and refused:
    the previous list stays in force."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config = load_config(self.path)  # a bad file at start-up is fatal, later ones are not
        self._stamp = self._mtime()

    def _mtime(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return None

    def reload(self) -> bool:
        stamp = self._mtime()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            self.config = load_config(self.path)
        except ConfigError as e:
            log.error("optimizer config refused, keeping the previous one: %s", e)
            return False
        return True

    async def deployments(self) -> list[Deployment]:
        self.reload()
        return list(self.config.deployments)


class StaticDeploymentSource:
    """A fixed list (tests, embedding)."""

    def __init__(self, deployments: list[Deployment]) -> None:
        self._deployments = list(deployments)

    async def deployments(self) -> list[Deployment]:
        return list(self._deployments)

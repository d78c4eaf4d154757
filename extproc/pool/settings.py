"""How pods are found: the config's `discovery:` section, typed (parsed by extproc.config.discovery)."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.pool.pod import MODEL_LABEL

PORT_KEY = "model.aibrix.ai/port"  # AIBrix's key for the serving port (annotation or label)
# Where a pod's GPU type is read from, first found wins; else the deployment name stands for it
# (the spec's prerequisite: one Deployment per GPU type).
DEFAULT_GPU_LABELS = ("machine.cluster.vke.volcengine.com/gpu-name", "nvidia.com/gpu.product")
KINDS = ("static", "kubernetes")
DISCOVERY_KEYS = frozenset({"kind", "namespace", "port_annotation", "gpu_labels", "kubeconfig",
                            "label_selector", "watch_timeout_seconds", "backoff_seconds",
                            "max_backoff_seconds"})


@dataclass(slots=True, frozen=True)
class DiscoverySettings:
    kind: str = "static"  # "static": the pods are the config file's; "kubernetes": watched
    namespace: str | None = None  # None: all namespaces
    port_annotation: str = PORT_KEY
    gpu_labels: tuple[str, ...] = DEFAULT_GPU_LABELS
    kubeconfig: str | None = None  # None: in-cluster service account, else ~/.kube/config
    label_selector: str = MODEL_LABEL  # further restrictions may be added: "model.aibrix.ai/name,team=a"
    watch_timeout_seconds: float = 300.0  # the server ends each watch after this; it resumes at once
    backoff_seconds: float = 0.5
    max_backoff_seconds: float = 30.0
    # Running in a pod (KUBERNETES_SERVICE_HOST set, read by the config loader): with no kubeconfig
    # named, the service account's credentials are used.
    in_cluster: bool = False

    @property
    def enabled(self) -> bool:
        return self.kind == "kubernetes"

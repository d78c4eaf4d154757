"""How pods are found: the config's `discovery:` section, typed (parsed by extproc.config.discovery)."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.pool.pod import MODEL_LABEL

PORT_KEY = "model.aibrix.ai/port"  # AIBrix's key for the serving port (annotation or label)
# Where a pod's GPU type is read from, first found wins; else the deployment name stands for it
# (the spec's prerequisite: one Deployment per GPU type).
DEFAULT_GPU_LABELS = ("machine.cluster.vke.volcengine.com/gpu-name", "nvidia.com/gpu.product")
KINDS = ("static", "kubernetes", "inferencepool")
DISCOVERY_KEYS = frozenset({"kind", "namespace", "port_annotation", "gpu_labels", "kubeconfig",
                            "label_selector", "watch_timeout_seconds", "backoff_seconds",
                            "max_backoff_seconds", "inferencepool"})
INFERENCEPOOL_KEYS = frozenset({"name", "namespace", "model"})
# The Gateway API Inference Extension's pool: inference.networking.k8s.io/v1, kind InferencePool
POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"


@dataclass(slots=True, frozen=True)
class InferencePoolRef:
    """`discovery.inferencepool`: the pool whose selector and target ports choose the pods."""
    name: str
    namespace: str = "default"
    # The model the pool's pods serve, as requests name it. None: each pod's model.aibrix.ai/name
    # label, else the pool's name (an InferencePool serves one base model).
    model: str | None = None


@dataclass(slots=True, frozen=True)
class DiscoverySettings:
    # "static": the pods are the config file's; "kubernetes": the labelled pods, watched;
    # "inferencepool": an InferencePool's pods (its selector and target ports), watched
    kind: str = "static"
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
    inferencepool: InferencePoolRef | None = None  # kind "inferencepool": the pool followed

    @property
    def enabled(self) -> bool:
        return self.kind != "static"

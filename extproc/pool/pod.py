"""A pod is one serving replica of a model: an engine at an ip:port on some GPU type."""

from __future__ import annotations

from dataclasses import dataclass, field

PodKey = tuple[str, str, str]  # (model, pod name, address): a pod that reappears elsewhere is a new pod

ENGINES = ("vllm", "sglang", "trtllm")
MODEL_LABEL = "model.aibrix.ai/name"           # AIBrix's label naming the model a pod (or Deployment) serves
ENGINE_LABEL = "model.aibrix.ai/engine"        # AIBrix's label naming a pod's inference engine
METRIC_PORT_LABEL = "model.aibrix.ai/metric-port"
# A pod's deployment, when the pool config does not name it (AIBrix's labels, in this order)
FLEET_LABEL = "orchestration.aibrix.ai/raycluster-fleet-name"
APP_NAME_LABEL = "app.kubernetes.io/name"


@dataclass(slots=True, frozen=True)
class Pod:
    model: str
    name: str
    address: str  # "ip:port": Envoy's ORIGINAL_DST cluster connects to exactly this
    deployment: str = ""
    labels: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    ready: bool = True
    namespace: str = "default"
    engine: str = "vllm"           # which metric names its /metrics uses
    metrics_port: int | None = None  # None: the serving port

    @property
    def key(self) -> PodKey:
        return (self.model, self.name, self.address)

    @property
    def gpu(self) -> str:
        return self.labels.get("gpu", "")

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0]

    @property
    def metrics_url(self) -> str:
        port = self.metrics_port or int(self.address.rpartition(":")[2])
        return f"http://{self.host}:{port}/metrics"


def deployment_of(pod: Pod) -> str:
    """The pool config's deployment, else the fleet label, else app.kubernetes.io/name. (Discovered
    pods already carry the ReplicaSet owner's name without its hash: extproc.pool.convert.)"""
    if pod.deployment:
        return pod.deployment
    labels = pod.labels or {}
    return labels.get(FLEET_LABEL) or labels.get(APP_NAME_LABEL) or ""

"""deploy/: every kustomize directory renders with `kubectl kustomize`, core resources pass the Kubernetes
schemas (kubernetes-validate, strict), and the custom resources (Envoy Gateway, Gateway API, AIBrix,
Prometheus Operator) that no offline schema covers are checked field by field, including that the
pieces name each other correctly."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from extproc.config import parse
from extproc.config.schema import DEFAULT_MODEL_PATHS
from extproc.envoy_contract import DEFAULT_DESTINATION_HEADER, ENVOY_BUFFER_BYTES
from extproc.optimizer.deployments import Deployment
from extproc.optimizer.deployments import load_config as load_optimizer_config
from extproc.optimizer.kubernetes import deployment_from_object
from extproc.pool.convert import pod_from_object
from extproc.pool.settings import DiscoverySettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DIRECTORIES = [
    ".",
    "namespace",
    "gateway-plugin",
    "redis",
    "envoy-gateway",
    "optimizer",
    "observability",
    "overlays/tls",
    "samples/heterogeneous",
    "samples/heterogeneous-keda",
    "samples/heterogeneous-hpa",
    "samples/inferencepool",
    "samples/inferencepool/fail-close",
]
K8S_VERSION = "1.30.0"
CORE_GROUPS = ("v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1", "networking.k8s.io/v1",
               "autoscaling/v2")
CUSTOM = {
    "gateway.networking.k8s.io/v1",
    "gateway.envoyproxy.io/v1alpha1",
    "autoscaling.aibrix.ai/v1alpha1",
    "monitoring.coreos.com/v1",
    "keda.sh/v1alpha1",
    "inference.networking.k8s.io/v1",  # checked against the CRD's own schema (tests/data/crds)
}


@cache
def render(directory: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render deploy/ (make kubectl installs Debian's kubernetes-client)"
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / directory)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def find(docs, kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs, kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def everything() -> tuple[dict[str, Any], ...]:
    return render(".") + render("samples/heterogeneous")


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_renders_and_core_resources_match_kubernetes_schemas(directory: str) -> None:
    docs = render(directory)
    assert docs
    for doc in docs:
        assert doc["apiVersion"] in CORE_GROUPS or doc["apiVersion"] in CUSTOM, doc["apiVersion"]
        assert doc["metadata"].get("name"), doc
        if doc["apiVersion"] in CORE_GROUPS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any schema error
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding", "GatewayClass"):
            assert doc["metadata"].get("namespace"), (
                f"{doc['kind']} {doc['metadata']['name']} has no namespace"
            )


def test_schema_validation_would_catch_a_mistake() -> None:
    deployment = json.loads(json.dumps(one(render("gateway-plugin"), "Deployment")))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_gateway_plugin_deployment() -> None:
    docs = render(".")
    dep = one(docs, "Deployment", "extproc-gateway")
    spec, pod = dep["spec"], dep["spec"]["template"]["spec"]
    assert spec["replicas"] == 2
    (container,) = pod["containers"]
    assert container["args"][:2] == ["--config", "/etc/extproc/gateway.yaml"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["grpc"]["port"] == 50052, probe
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    labels = spec["template"]["metadata"]["labels"]
    pdb = one(docs, "PodDisruptionBudget", "extproc-gateway")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] == 1
    svc = one(docs, "Service", "extproc-gateway")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert {p["port"] for p in svc["spec"]["ports"]} == {50052, 9090}
    # the mounted ConfigMap is the generated one, and it is a valid gateway config with discovery on
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    config_map = one(docs, "ConfigMap", volume["configMap"]["name"])
    config = parse(yaml.safe_load(config_map["data"]["gateway.yaml"]), {})
    assert config.discovery.enabled and config.redis_url
    assert config.destination_header == DEFAULT_DESTINATION_HEADER
    assert pod["serviceAccountName"] == "extproc-gateway"


def test_rbac_is_read_only_on_pods() -> None:
    docs = render(".")
    role = one(docs, "ClusterRole", "extproc-gateway-pod-reader")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = one(docs, "ClusterRoleBinding", "extproc-gateway-pod-reader")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "extproc-gateway", "namespace": "extproc-system"}
    ]


def test_network_policy_lets_only_envoy_reach_ext_proc() -> None:
    docs = render(".")
    policy = one(docs, "NetworkPolicy", "extproc-gateway")
    gateway_labels = one(docs, "Deployment", "extproc-gateway")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= gateway_labels.items()
    grpc_rules = [r for r in policy["spec"]["ingress"] if any(p["port"] == 50052 for p in r["ports"])]
    assert len(grpc_rules) == 1
    (source,) = grpc_rules[0]["from"]
    assert (
        source["podSelector"]["matchLabels"]["gateway.envoyproxy.io/owning-gateway-name"]
        == one(docs, "Gateway")["metadata"]["name"]
    )
    assert source["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "envoy-gateway-system"
    }
    other = [r for r in policy["spec"]["ingress"] if r is not grpc_rules[0]]
    assert all(p["port"] != 50052 for r in other for p in r["ports"])


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m|h)", text)
    assert match, text
    return int(match[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[match[2]]


def _bytes(text: str | int) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", str(text))
    assert match, text
    return int(match[1]) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}[match[2]]


def test_envoy_gateway_resources_reference_each_other() -> None:
    docs = render(".")
    gateway_class = one(docs, "GatewayClass")
    assert gateway_class["spec"]["controllerName"] == "gateway.envoyproxy.io/gatewayclass-controller"
    proxy_ref = gateway_class["spec"]["parametersRef"]
    proxy = one(docs, "EnvoyProxy", proxy_ref["name"])
    assert proxy["metadata"]["namespace"] == proxy_ref["namespace"]
    gateway = one(docs, "Gateway")
    assert gateway["spec"]["gatewayClassName"] == gateway_class["metadata"]["name"]
    (listener,) = gateway["spec"]["listeners"]
    assert listener["protocol"] == "HTTP" and listener["name"]

    route = one(docs, "HTTPRoute")
    assert route["spec"]["parentRefs"] == [{"name": gateway["metadata"]["name"]}]
    paths = {m["path"]["value"] for rule in route["spec"]["rules"] for m in rule["matches"]}
    assert paths == {"/v1/chat/completions", "/v1/completions", "/v1/embeddings"}

    policy = one(docs, "EnvoyExtensionPolicy")
    assert policy["spec"]["targetRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": route["metadata"]["name"]}
    ]
    (ext_proc,) = policy["spec"]["extProc"]
    (backend,) = ext_proc["backendRefs"]
    service = one(docs, "Service", backend["name"])
    assert backend["port"] in {p["port"] for p in service["spec"]["ports"]}
    # request side only (the response is tallied in Envoy), buffered body, long enough for big prompts
    assert ext_proc["processingMode"] == {"request": {"body": "Buffered"}}
    assert _seconds(ext_proc["messageTimeout"]) >= 300 and ext_proc["failOpen"] is False
    (lua,) = policy["spec"]["lua"]
    lua_map = one(docs, "ConfigMap", lua["valueRef"]["name"])
    assert lua_map["data"]["lua"] == (ROOT / "extproc/envoy/tally.lua").read_text()

    (sink,) = proxy["spec"]["telemetry"]["accessLog"]["settings"][0]["sinks"]
    assert sink["type"] == "ALS" and sink["als"]["type"] == "HTTP"
    (als_backend,) = sink["als"]["backendRefs"]
    assert (als_backend["name"], als_backend["port"]) == (backend["name"], backend["port"])

    traffic = one(docs, "ClientTrafficPolicy")
    assert traffic["spec"]["targetRefs"][0]["name"] == gateway["metadata"]["name"]
    assert _bytes(traffic["spec"]["connection"]["bufferLimit"]) >= ENVOY_BUFFER_BYTES


def test_patch_policy_adds_the_original_destination_route_and_cluster() -> None:
    docs = render(".")
    gateway = one(docs, "Gateway")
    ns, name = gateway["metadata"]["namespace"], gateway["metadata"]["name"]
    patch = one(docs, "EnvoyPatchPolicy")
    assert patch["spec"]["type"] == "JSONPatch"
    assert patch["spec"]["targetRef"] == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": name,
    }
    by_type = {p["type"].rsplit(".", 1)[1]: p for p in patch["spec"]["jsonPatches"]}
    cluster = by_type["Cluster"]["operation"]["value"]
    assert cluster["type"] == "ORIGINAL_DST" and cluster["lb_policy"] == "CLUSTER_PROVIDED"
    assert cluster["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": DEFAULT_DESTINATION_HEADER,
    }
    route_patch = by_type["RouteConfiguration"]
    assert route_patch["name"] == f"{ns}/{name}/{gateway['spec']['listeners'][0]['name']}"
    assert route_patch["operation"]["op"] == "add"
    route = route_patch["operation"]["value"]
    assert route["route"]["cluster"] == cluster["name"]
    policy = one(docs, "EnvoyExtensionPolicy")
    prefix = f"envoyextensionpolicy/{policy['metadata']['namespace']}/{policy['metadata']['name']}"
    assert set(route["typed_per_filter_config"]) == {
        f"envoy.filters.http.ext_proc/{prefix}/extproc/0",
        f"envoy.filters.http.lua/{prefix}/lua/0",
    }
    regex = re.compile(route["match"]["safe_regex"]["regex"])
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        assert regex.fullmatch(path), path
    assert not regex.fullmatch("/v1/models") and not regex.fullmatch("/metrics")


def test_optimizer_deployment_and_config(tmp_path: Path) -> None:
    docs = render(".")
    dep = one(docs, "Deployment", "extproc-optimizer")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["extproc", "optimizer"]
    # discovery on, in every namespace, with read-only access to Deployments and their autoscalers
    path = tmp_path / "optimizer.yaml"
    path.write_text(one(docs, "ConfigMap", "extproc-optimizer-config")["data"]["optimizer.yaml"])
    config = load_optimizer_config(path)
    assert config.kubernetes is not None and config.kubernetes.namespaces == () and config.deployments == ()
    assert config.kubernetes.autoscalers == ("hpa",)  # the HPAs' maxReplicas cap the plan
    args = container["args"]
    assert args[args.index("--config") + 1] == "/etc/extproc-optimizer/optimizer.yaml"
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "extproc-optimizer" and pod["automountServiceAccountToken"] is True
    role = one(docs, "ClusterRole", "extproc-optimizer-deployment-reader")
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["autoscaling.aibrix.ai"], "resources": ["podautoscalers"],
         "verbs": ["get", "list", "watch"]},
    ]
    binding = one(docs, "ClusterRoleBinding", "extproc-optimizer-deployment-reader")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "extproc-optimizer", "namespace": "extproc-system"}
    ]
    svc = one(docs, "Service", "extproc-optimizer")
    assert svc["spec"]["ports"][0]["port"] == 8080
    assert (
        "--port" in container["args"] and container["args"][container["args"].index("--port") + 1] == "8080"
    )


def test_heterogeneous_sample_follows_the_spec(tmp_path: Path) -> None:
    docs = render("samples/heterogeneous")
    deployments = find(docs, "Deployment")
    assert {d["metadata"]["name"] for d in deployments} == {"deepseek-coder-7b-l20", "deepseek-coder-7b-v100"}
    models = {d["metadata"]["labels"]["model.aibrix.ai/name"] for d in deployments}
    assert models == {"deepseek-coder-7b"}
    assert [
        d["metadata"]["name"]
        for d in deployments
        if d["metadata"]["labels"].get("model.aibrix.ai/min_replicas") == "1"
    ] == ["deepseek-coder-7b-v100"]
    gpus = set()
    for dep in deployments:
        terms = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        (expr,) = terms[0]["matchExpressions"]
        assert expr["key"] == "machine.cluster.vke.volcengine.com/gpu-name"
        gpus.add(expr["values"][0])
        # what the gateway's discovery makes of a Ready pod of this Deployment
        template = dep["spec"]["template"]
        pod = pod_from_object(
            {
                "metadata": {
                    **template["metadata"],
                    "name": f"{dep['metadata']['name']}-abc12",
                    "namespace": "default",
                    "ownerReferences": [
                        {"kind": "ReplicaSet", "name": f"{dep['metadata']['name']}-5d8f9c7b4"}
                    ],
                },
                "spec": template["spec"],
                "status": {
                    "phase": "Running",
                    "podIP": "10.0.0.7",
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            },
            DiscoverySettings(kind="kubernetes"),
        )
        assert (pod.model, pod.address, pod.deployment, pod.gpu, pod.ready) == (
            "deepseek-coder-7b",
            "10.0.0.7:8000",
            dep["metadata"]["name"],
            expr["values"][0],
            True,
        )
    assert len(gpus) == 2

    optimizer = one(render("."), "Service", "extproc-optimizer")
    host = f"{optimizer['metadata']['name']}.{optimizer['metadata']['namespace']}.svc.cluster.local:8080"
    autoscalers = find(docs, "PodAutoscaler")
    assert len(autoscalers) == 2
    for pa in autoscalers:
        spec = pa["spec"]
        assert spec["minReplicas"] == 0 and spec["maxReplicas"] >= 1
        target = spec["scaleTargetRef"]
        assert target["kind"] == "Deployment" and one(docs, "Deployment", target["name"])
        (source,) = spec["metricsSources"]
        assert source["endpoint"] == host
        assert source["path"] == f"/metrics/default/{target['name']}"
        assert (
            source["targetMetric"] == "vllm:deployment_replicas" and source["metricSourceType"] == "external"
        )
        assert source["protocolType"] == "http" and float(source["targetValue"]) > 0

    # what the optimizer's discovery makes of these Deployments: the model, the floor, spec.replicas
    found = {deployment_from_object(d) for d in deployments}
    assert found == {Deployment("default", "deepseek-coder-7b-l20", "deepseek-coder-7b", 0, 4),
                     Deployment("default", "deepseek-coder-7b-v100", "deepseek-coder-7b", 1, 0)}


def test_service_monitors_select_existing_ports() -> None:
    docs = everything()
    monitors = find(docs, "ServiceMonitor")
    assert len(monitors) == 3
    for monitor in monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        services = [
            s
            for s in find(docs, "Service")
            if selector.items() <= s["metadata"].get("labels", {}).items()
            and s["metadata"]["namespace"] == monitor["metadata"]["namespace"]
        ]
        assert len(services) == 1, monitor["metadata"]["name"]
        ports = {p["name"] for p in services[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in ports and endpoint["path"].startswith("/metrics")


def serve_args(container: dict[str, Any]):
    """The container's arguments as `extproc serve` parses them (the image's entrypoint)."""
    from extproc.cli import build_parser

    return build_parser().parse_args(["serve", *container["args"]])


def test_gateway_args_are_ones_extproc_serve_accepts() -> None:
    (container,) = one(render("."), "Deployment", "extproc-gateway")["spec"]["template"]["spec"]["containers"]
    args = serve_args(container)
    assert (args.port, args.admin_port, args.host) == (50052, 9090, "0.0.0.0")
    assert args.tls_cert is None


def test_tls_overlay() -> None:
    docs = render("overlays/tls")
    dep = one(docs, "Deployment", "extproc-gateway")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = serve_args(container)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
    secret = next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]["secretName"]
    assert secret == "extproc-gateway-tls"
    for path in (args.tls_cert, args.tls_key, args.tls_client_ca):
        assert path and path.startswith(mount["mountPath"] + "/"), path
    ports = {p["name"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert "grpc" not in container[probe], probe  # kubelet's gRPC probes cannot speak TLS
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"} and "metrics" in ports
    service = one(docs, "Service", "extproc-gateway")
    grpc_port = next(p for p in service["spec"]["ports"] if p["port"] == 50052)
    assert "appProtocol" not in grpc_port  # not h2c any more
    policy = one(docs, "BackendTLSPolicy")
    (target,) = policy["spec"]["targetRefs"]
    assert (target["kind"], target["name"], target["sectionName"]) == (
        "Service",
        "extproc-gateway",
        grpc_port["name"],
    )
    svc = service["metadata"]
    assert policy["spec"]["validation"]["hostname"] == f"{svc['name']}.{svc['namespace']}.svc"
    assert policy["spec"]["validation"]["caCertificateRefs"][0]["kind"] == "ConfigMap"
    proxy = one(docs, "EnvoyProxy")
    assert proxy["spec"]["backendTLS"]["clientCertificateRef"]["kind"] == "Secret"
    assert proxy["spec"]["telemetry"]["accessLog"]  # the patch kept the rest
    # everything else is deploy/'s
    base = {(d["kind"], d["metadata"]["name"]) for d in render(".")}
    assert base <= {(d["kind"], d["metadata"]["name"]) for d in docs}


def optimizer_metric_names() -> set[str]:
    from prometheus_client import generate_latest

    from extproc.optimizer.metrics import optimizer_registry
    from extproc.optimizer.monitor import Fleet

    text = generate_latest(optimizer_registry(Fleet(), lambda: 0.0)).decode()
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


def test_keda_sample_scales_each_type_on_the_optimizers_figure_down_to_zero() -> None:
    docs = render("samples/heterogeneous-keda")
    assert not find(docs, "PodAutoscaler")  # one autoscaler per Deployment, not two fighting
    deployments = {d["metadata"]["name"]: d for d in find(docs, "Deployment")}
    scaled = find(docs, "ScaledObject")
    assert sorted(s["spec"]["scaleTargetRef"]["name"] for s in scaled) == sorted(deployments)
    exported = optimizer_metric_names()
    for so in scaled:
        spec, target = so["spec"], deployments[so["spec"]["scaleTargetRef"]["name"]]
        assert so["metadata"]["namespace"] == target["metadata"]["namespace"]
        assert spec["scaleTargetRef"]["kind"] == "Deployment" and spec["minReplicaCount"] == 0
        assert spec["maxReplicaCount"] >= 1
        (trigger,) = spec["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "prometheus"
        assert (meta["threshold"], meta["activationThreshold"]) == ("1", "0")  # exactly the plan; 0 -> zero
        query = re.fullmatch(r'max\((\w+)\{namespace="([^"]+)",deployment="([^"]+)"\}\)', meta["query"])
        assert query, meta["query"]
        assert query.group(1) in exported
        assert query.groups()[1:] == (target["metadata"]["namespace"], target["metadata"]["name"])
    monitor = one(render("observability"), "ServiceMonitor", "extproc-optimizer")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["honorLabels"] is True  # its namespace label kept


def test_hpa_sample_reads_the_figure_as_an_external_metric() -> None:
    docs = render("samples/heterogeneous-hpa")
    assert not find(docs, "PodAutoscaler")
    deployments = {d["metadata"]["name"] for d in find(docs, "Deployment")}
    hpas = find(docs, "HorizontalPodAutoscaler")
    assert sorted(h["spec"]["scaleTargetRef"]["name"] for h in hpas) == sorted(deployments)
    exported = optimizer_metric_names()
    for hpa in hpas:
        (metric,) = hpa["spec"]["metrics"]
        external = metric["external"]
        assert metric["type"] == "External" and external["metric"]["name"] in exported
        target = hpa["spec"]["scaleTargetRef"]["name"]
        assert external["metric"]["selector"]["matchLabels"] == {"deployment": target}
        assert external["target"] == {"type": "AverageValue", "averageValue": "1"}
    rules = yaml.safe_load(one(docs, "ConfigMap", "extproc-prometheus-adapter")["data"]["config.yaml"])
    (rule,) = rules["externalRules"]
    assert rule["name"]["as"] in exported and rule["seriesQuery"].startswith(rule["name"]["as"])
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}


# -- deploy/samples/inferencepool: extproc as an InferencePool's endpoint picker ---------------------

POOL_CRD = json.loads((ROOT / "tests/data/crds/inferencepool-v1.json").read_text())
ROUTE_CRD = json.loads((ROOT / "tests/data/crds/httproute-v1.json").read_text())


def strict(schema: Any) -> Any:
    """The schema as `kubectl apply --validate=strict` applies it: a field it does not declare is an
    error (a structural schema would otherwise prune it silently, as it would v1alpha2's extensionRef)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def check_inference_pool(pool: dict[str, Any]) -> None:
    """The InferencePool CRD's OpenAPI schema (tests/data/crds, from the Inference Extension's
    repository), strictly, and its two CEL rules by hand: unique target ports; a Service picker
    names a port."""
    import jsonschema

    jsonschema.validate(pool, strict(POOL_CRD["openAPIV3Schema"]))
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers)), "targetPorts must be unique"
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref, "a Service picker needs its port"


@pytest.mark.parametrize(("directory", "mode"), [("samples/inferencepool", "FailOpen"),
                                                 ("samples/inferencepool/fail-close", "FailClose")])
def test_inferencepool_sample_names_the_picker_and_its_pods(directory: str, mode: str) -> None:
    docs = render(directory)
    pool = one(docs, "InferencePool")
    check_inference_pool(pool)
    ns = pool["metadata"]["namespace"]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == mode
    # endpointPickerRef names the picker's Service and its gRPC port, which reaches the picker's
    # container port that `extproc serve` listens on
    assert (ref["group"], ref["kind"]) == ("", "Service")
    service = one(docs, "Service", ref["name"])
    assert service["metadata"]["namespace"] == ns
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc["appProtocol"] == "kubernetes.io/h2c"
    picker = one(docs, "Deployment", "extproc-picker")
    assert service["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    (container,) = picker["spec"]["template"]["spec"]["containers"]
    args = serve_args(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[grpc["targetPort"]] == args.port == ref["port"]["number"]
    # gRPC probes on the picker's port with the protocol's health service names
    for probe, service_name in (("startupProbe", "liveness"), ("livenessProbe", "liveness"),
                                ("readinessProbe", "readiness")):
        assert container[probe]["grpc"] == {"port": args.port, "service": service_name}, probe

    # the mounted config is a valid gateway config that follows this pool, in the picker's namespace
    volume = next(v for v in picker["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    config_map = one(docs, "ConfigMap", volume["configMap"]["name"])
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
    assert env["POD_NAMESPACE"] == "metadata.namespace"
    config = parse(yaml.safe_load(config_map["data"]["gateway.yaml"]), {"POD_NAMESPACE": ns})
    assert config.discovery.inferencepool is not None
    assert (config.discovery.inferencepool.name, config.discovery.inferencepool.namespace) == \
        (pool["metadata"]["name"], ns)

    # the pool selects every model server's pods, on the port they serve
    servers = [d for d in find(docs, "Deployment") if d is not picker]
    assert len(servers) == 2
    selector = pool["spec"]["selector"]["matchLabels"]
    for dep in servers:
        template = dep["spec"]["template"]
        assert selector.items() <= template["metadata"]["labels"].items(), dep["metadata"]["name"]
        (server,) = template["spec"]["containers"]
        served = {p["containerPort"] for p in server["ports"]}
        assert {p["number"] for p in pool["spec"]["targetPorts"]} <= served
    assert not selector.items() <= picker["spec"]["template"]["metadata"]["labels"].items()  # not itself

    # the HTTPRoute's backend is the pool, on the inference paths
    route = one(docs, "HTTPRoute")
    check_http_route(route)
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]
    assert {m["path"]["value"] for m in rule["matches"]} == set(DEFAULT_MODEL_PATHS)
    assert route["metadata"]["namespace"] == ns


def check_http_route(route: dict[str, Any]) -> None:
    """Gateway API's HTTPRoute schema (tests/data/crds, v1.6.1's standard channel), strictly."""
    import jsonschema

    jsonschema.validate(route, strict(ROUTE_CRD["openAPIV3Schema"]))


@pytest.mark.parametrize("directory", [d for d in DIRECTORIES if d != "."])
def test_every_http_route_matches_the_gateway_api_schema(directory: str) -> None:
    for route in find(render(directory), "HTTPRoute"):
        check_http_route(route)


def test_http_route_schema_check_would_catch_a_mistake() -> None:
    import jsonschema

    route = one(render("samples/inferencepool"), "HTTPRoute")
    for change in ({"name": "a-service", "port": 70000},
                   {"group": "Not A Group", "kind": "InferencePool", "name": "x"},
                   {"kind": "InferencePool", "name": "x", "extensionRef": "epp"}):
        bad = json.loads(json.dumps(route))
        bad["spec"]["rules"][0]["backendRefs"] = [change]
        with pytest.raises(jsonschema.ValidationError):
            check_http_route(bad)


def test_inferencepool_schema_check_would_catch_a_mistake() -> None:
    import jsonschema

    pool = json.loads(json.dumps(one(render("samples/inferencepool"), "InferencePool")))
    bad_mode = json.loads(json.dumps(pool))
    bad_mode["spec"]["endpointPickerRef"]["failureMode"] = "Open"
    bad_port = json.loads(json.dumps(pool))
    bad_port["spec"]["targetPorts"] = [{"number": 70000}]
    old_name = json.loads(json.dumps(pool))
    old_name["spec"]["extensionRef"] = old_name["spec"].pop("endpointPickerRef")  # v1alpha2's field
    for bad in (bad_mode, bad_port, old_name):
        with pytest.raises(jsonschema.ValidationError):
            check_inference_pool(bad)
    duplicate = json.loads(json.dumps(pool))
    duplicate["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    with pytest.raises(AssertionError, match="unique"):
        check_inference_pool(duplicate)


def test_inferencepool_picker_rbac_is_read_only_in_its_namespace() -> None:
    docs = render("samples/inferencepool")
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    role = one(docs, "Role", "extproc-picker")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
         "verbs": ["get", "list", "watch"]},
    ]
    binding = one(docs, "RoleBinding", "extproc-picker")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "extproc-picker"}
    picker = one(docs, "Deployment", "extproc-picker")
    account = picker["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": picker["metadata"]["namespace"]}]
    assert one(docs, "ServiceAccount", account)

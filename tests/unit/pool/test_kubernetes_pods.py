"""Pure parts of Kubernetes discovery: a pod object as a Pod, and the config's `discovery:` section."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.config import ConfigError, parse
from extproc.pool.convert import deployment_from_metadata, pod_from_object
from extproc.pool.settings import DiscoverySettings

S = DiscoverySettings(kind="kubernetes")


def obj(**over):
    base = {"metadata": {"name": "p", "namespace": "ns", "labels": {"model.aibrix.ai/name": "m"},
                         "annotations": {}},
            "spec": {"containers": [{"ports": [{"containerPort": 9000}, {"name": "http",
                                                                        "containerPort": 8000}]}]},
            "status": {"phase": "Running", "podIP": "10.1.2.3",
                       "conditions": [{"type": "Ready", "status": "True"}]}}
    for path, value in over.items():
        target = base
        *parents, leaf = path.split("__")
        for key in parents:
            target = target[key]
        target[leaf] = value
    return base


def test_port_from_annotation_then_named_container_port() -> None:
    assert pod_from_object(obj(), S).address == "10.1.2.3:8000"
    assert pod_from_object(obj(metadata__annotations={"model.aibrix.ai/port": "8100"}), S).address \
        == "10.1.2.3:8100"
    custom = DiscoverySettings(kind="kubernetes", port_annotation="example.com/port")
    assert pod_from_object(obj(metadata__annotations={"example.com/port": "7000"}), custom).address \
        == "10.1.2.3:7000"
    assert pod_from_object(obj(spec={"containers": [{}]}), S) is None  # no port at all
    assert pod_from_object(obj(status__podIP="fd00::1"), S).address == "[fd00::1]:8000"
    assert pod_from_object(obj(status__podIP="pod-a.local"), S) is None  # ORIGINAL_DST needs an IP


def test_ready_only_when_running_ready_and_not_terminating() -> None:
    assert pod_from_object(obj(), S).ready
    assert not pod_from_object(obj(status__conditions=[{"type": "Ready", "status": "False"}]), S).ready
    assert not pod_from_object(obj(metadata__deletionTimestamp="2026-01-01T00:00:00Z"), S).ready
    assert pod_from_object(obj(status__phase="Failed"), S) is None
    assert pod_from_object(obj(metadata__labels={"app": "x"}), S) is None  # no model label


def test_deployment_rule_and_gpu_and_engine() -> None:
    labels = {"model.aibrix.ai/name": "m", "model.aibrix.ai/engine": "SGLang", "pod-template-hash": "7d9f8"}
    owner = [{"kind": "ReplicaSet", "name": "m-l20-7d9f8"}]
    pod = pod_from_object(obj(metadata__labels=labels, metadata__ownerReferences=owner), S)
    assert (pod.deployment, pod.gpu, pod.engine) == ("m-l20", "m-l20", "sglang")
    labels["machine.cluster.vke.volcengine.com/gpu-name"] = "L20"
    labels["app.kubernetes.io/name"] = "app-name"
    pod = pod_from_object(obj(metadata__labels=labels, metadata__ownerReferences=owner), S)
    assert (pod.deployment, pod.gpu) == ("app-name", "L20")
    assert deployment_from_metadata({"labels": {"orchestration.aibrix.ai/raycluster-fleet-name": "fleet",
                                     "app.kubernetes.io/name": "app-name"}}) == "fleet"
    assert deployment_from_metadata({"ownerReferences": [{"kind": "ReplicaSet", "name": "dep-5c7b9d6f4"}]}) == "dep"


def test_discovery_section() -> None:
    assert not parse({"models": {}}, {}).discovery.enabled  # the static file is the default
    config = parse({"discovery": {"kind": "kubernetes", "namespace": "serving", "gpu_labels": ["gpu"]}}, {})
    assert config.discovery.enabled and config.discovery.namespace == "serving"
    assert config.discovery.gpu_labels == ("gpu",)
    for bad, named in [({"kind": "consul"}, "discovery.kind"), ({"kind": "kubernetes", "namspace": "x"},
                       "discovery.namspace"), ({"label_selector": "app=x"}, "discovery.label_selector"),
                       ({"backoff_seconds": 0}, "discovery.backoff_seconds")]:
        with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
            parse({"models": {}, "discovery": bad}, {})
    with pytest.raises(ConfigError, match="names no models"):
        parse({"discovery": {"kind": "static"}}, {})


def test_check_config_names_discovery(tmp_path, capsys) -> None:
    from extproc.cli import main

    path = tmp_path / "gateway.yaml"
    path.write_text("discovery: {kind: kubernetes, namespace: serving}\n")
    assert main(["check-config", str(path)]) == 0
    assert "discovery: kubernetes, pods labelled model.aibrix.ai/name in serving" in capsys.readouterr().out


# Whatever shape a pod object has, converting it never raises: an exception in the watch would be
# taken for a broken connection and relist forever.
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=3), max_leaves=12)
_maybe = st.one_of(_json, st.fixed_dictionaries({}, optional={
    "labels": st.dictionaries(st.sampled_from(["model.aibrix.ai/name", "model.aibrix.ai/engine",
                                               "model.aibrix.ai/port", "pod-template-hash", "x"]), _json),
    "annotations": _json, "ownerReferences": _json, "name": _json, "namespace": _json,
    "deletionTimestamp": _json, "podIP": _json, "phase": _json, "conditions": _json, "containers": _json,
}))


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={"metadata": _maybe, "spec": _maybe, "status": _maybe}))
def test_any_object_converts_or_is_skipped(obj) -> None:
    pod = pod_from_object(obj, S)
    assert pod is None or pod.model

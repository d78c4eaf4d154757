"""Pure parts of InferencePool discovery: the `discovery.inferencepool` section, a pool's spec, a member
pod as one Pod per target port."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.config import ConfigError, parse
from extproc.pool.convert import pool_pods_from_object
from extproc.pool.inferencepool import PoolSpec, pool_spec
from extproc.pool.settings import DiscoverySettings, InferencePoolRef

POOL = {"name": "llama", "namespace": "serving"}


def member(**labels: str) -> dict:
    return {"metadata": {"name": "vllm-0", "namespace": "serving", "labels": {"app": "vllm", **labels}},
            "spec": {"containers": [{"ports": [{"containerPort": 9999}]}]},
            "status": {"phase": "Running", "podIP": "10.0.0.7",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def test_the_section_turns_discovery_on_and_types_the_pool() -> None:
    d = parse({"discovery": {"inferencepool": POOL}}, {}).discovery
    assert (d.kind, d.enabled, d.inferencepool) == ("inferencepool", True,
                                                    InferencePoolRef("llama", "serving", None))
    # the namespace: the section's, else the gateway's own (POD_NAMESPACE), else "default"
    assert parse({"discovery": {"inferencepool": {"name": "llama"}}},
                 {"POD_NAMESPACE": "gw-ns"}).discovery.inferencepool.namespace == "gw-ns"
    assert parse({"discovery": {"kind": "inferencepool", "inferencepool": {"name": "p", "model": "m"}}},
                 {}).discovery.inferencepool == InferencePoolRef("p", "default", "m")


@pytest.mark.parametrize(("discovery", "named"), [
    ({"inferencepool": {"name": "llama", "namspace": "x"}},
     "discovery.inferencepool.namspace.*did you mean namespace"),
    ({"inferencepool": {"namespace": "x"}}, "discovery.inferencepool.name"),
    ({"inferencepool": {"name": "Llama_Pool"}}, "discovery.inferencepool.name"),
    ({"inferencepool": {"name": "llama", "namespace": "Not A Namespace"}},
     "discovery.inferencepool.namespace"),
    ({"inferencepool": {"name": "llama", "model": ""}}, "discovery.inferencepool.model"),
    ({"inferencepool": "llama"}, "discovery.inferencepool must be a mapping"),
    ({"kind": "kubernetes", "inferencepool": POOL}, "discovery.inferencepool is set"),
    ({"kind": "inferencepool"}, "discovery.inferencepool must be a mapping"),
    ({"inferencepool": POOL, "label_selector": "app=x"}, "discovery.label_selector does not apply"),
    ({"inferencepool": POOL, "namespace": "x"}, "discovery.namespace does not apply"),
    ({"inferencpool": POOL}, "discovery.inferencpool.*did you mean inferencepool"),
])
def test_bad_sections_are_refused_naming_the_key(discovery: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        parse({"discovery": discovery}, {})


def test_check_config_names_the_pool(tmp_path, capsys) -> None:
    from extproc.cli import main

    path = tmp_path / "gateway.yaml"
    path.write_text("discovery:\n  inferencepool: {name: llama, namespace: serving, model: m}\n")
    assert main(["check-config", str(path)]) == 0
    assert "discovery: InferencePool serving/llama" in capsys.readouterr().out


def test_pool_spec_reads_the_selector_and_ports() -> None:
    spec = pool_spec({"spec": {"selector": {"matchLabels": {"b": "2", "a": "1"}},
                               "targetPorts": [{"number": 8000}, {"number": 8001}, {"number": 8000},
                                               {"number": 0}, {"number": True}, {}]}})
    assert spec == PoolSpec((("a", "1"), ("b", "2")), (8000, 8001))
    assert spec.label_selector == "a=1,b=2" and spec.selects
    assert not pool_spec({"spec": {"targetPorts": [{"number": 8000}]}}).selects  # no selector: no pods
    assert not pool_spec({"spec": {"selector": {"matchLabels": {"a": "1"}}}}).selects  # no port


def test_a_member_is_a_pod_per_target_port() -> None:
    s = DiscoverySettings(kind="inferencepool", inferencepool=InferencePoolRef("llama", "serving", "m"))
    (pod,) = pool_pods_from_object(member(), s, (8000,), "llama")
    # the pool's port, not the container's; the configured model
    assert (pod.name, pod.address, pod.model, pod.ready) == ("vllm-0", "10.0.0.7:8000", "m", True)
    ranks = pool_pods_from_object(member(), s, (8000, 8002), "llama")
    assert [(p.name, p.address) for p in ranks] == [("vllm-0-rank-0", "10.0.0.7:8000"),
                                                     ("vllm-0-rank-1", "10.0.0.7:8002")]
    unnamed = DiscoverySettings(kind="inferencepool", inferencepool=InferencePoolRef("llama"))
    assert pool_pods_from_object(member(), unnamed, (8000,), "llama")[0].model == "llama"
    labelled = member(**{"model.aibrix.ai/name": "llama-8b"})
    assert pool_pods_from_object(labelled, unnamed, (8000,), "llama")[0].model == "llama-8b"
    pending = member()
    del pending["status"]["podIP"]
    assert pool_pods_from_object(pending, s, (8000,), "llama") == ()


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=3), max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({}, optional={"spec": st.fixed_dictionaries({}, optional={
    "selector": _json | st.fixed_dictionaries({"matchLabels": _json}),
    "targetPorts": _json | st.lists(st.fixed_dictionaries({"number": _json}), max_size=3)})}))
def test_any_pool_object_reads_as_a_spec(obj) -> None:
    """Total: an exception in the watch would be taken for a broken connection and relist forever."""
    spec = pool_spec(obj)
    assert all(0 < p < 65536 for p in spec.ports)

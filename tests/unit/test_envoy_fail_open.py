"""gateway.fail_open in the Envoy bootstrap: closed by default; open only for the model paths, to each
model's own cluster, after the route the gateway's decision takes, without a client's destination header."""

from __future__ import annotations

import pytest

from extproc.config import ConfigError, parse
from extproc.envoy_bootstrap import BootstrapOptions, bootstrap, fail_open_upstreams
from extproc.envoy_contract import CLIENT_DESTINATION_HEADERS, FAIL_OPEN_NAMESPACE

EXT_PROC = "envoy.filters.http.ext_proc"


def parts(options: BootstrapOptions) -> tuple[dict, list[dict], list[dict], dict[str, dict]]:
    config = bootstrap(options)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f["typed_config"] for f in hcm["http_filters"] if f["name"] == EXT_PROC]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    return ext_proc, hcm["http_filters"], routes, clusters


def test_closed_by_default() -> None:
    ext_proc, filters, routes, clusters = parts(BootstrapOptions())
    assert ext_proc["failure_mode_allow"] is False
    assert [f["name"] for f in filters if "json_to_metadata" in f["name"]] == []
    assert not [c for c in clusters if c.startswith("fail-open")] and len(routes) == 3


def test_open_for_the_model_paths_to_each_models_pods() -> None:
    options = BootstrapOptions(
        fail_open=(("a", ("10.0.0.1:8000", "10.0.0.2:8000")), ("b", ("b-svc.ns:8000",))),
        model_paths=("/v1/chat/completions", "/v1/completions"))
    ext_proc, filters, routes, clusters = parts(options)
    assert ext_proc["failure_mode_allow"] is True
    names = [f["name"] for f in filters]
    assert names.index("envoy.filters.http.json_to_metadata") == names.index(EXT_PROC) + 1
    assert "dynamic_metadata" in routes[0]["match"] and routes[0]["route"]["cluster"] == "model_pods"
    opened = routes[1:5]
    assert [(r["match"]["path"], r["match"]["dynamic_metadata"][0]["value"]["string_match"]["exact"],
             r["route"]["cluster"]) for r in opened] == [
        ("/v1/chat/completions", "a", "fail-open-0"), ("/v1/completions", "a", "fail-open-0"),
        ("/v1/chat/completions", "b", "fail-open-1"), ("/v1/completions", "b", "fail-open-1")]
    for r in opened:
        assert r["match"]["dynamic_metadata"][0]["filter"] == FAIL_OPEN_NAMESPACE
        assert "prefix" not in r["match"]  # exact paths: never an engine's other endpoints
        assert set(CLIENT_DESTINATION_HEADERS) <= set(r["request_headers_to_remove"])
    assert all("direct_response" in r for r in routes[5:])
    a = clusters["fail-open-0"]
    assert a["lb_policy"] == "ROUND_ROBIN" and a["type"] == "STRICT_DNS"
    endpoints = a["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"] for e in endpoints] == [
        {"address": "10.0.0.1", "port_value": 8000}, {"address": "10.0.0.2", "port_value": 8000}]


def test_the_gateway_config_names_the_upstreams() -> None:
    pods = {"m": {"pods": [{"name": "p0", "address": "10.0.0.1:8000"},
                           {"name": "p1", "address": "10.0.0.2:8000"}]},
            "n": {"pods": [{"name": "q", "address": "[::1]:9000"}]}}
    assert fail_open_upstreams(parse({"models": pods}, {})) == ()
    opened = fail_open_upstreams(parse({"models": pods, "gateway": {"fail_open": True}}, {}))
    assert opened == (("m", ("10.0.0.1:8000", "10.0.0.2:8000")), ("n", ("[::1]:9000",)))
    _, _, _, clusters = parts(BootstrapOptions(fail_open=opened))
    (ipv6,) = clusters["fail-open-1"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert ipv6["endpoint"]["address"]["socket_address"] == {"address": "::1", "port_value": 9000}


def test_a_bad_flag_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="fail_open"):
        parse({"models": {}, "gateway": {"fail_open": "yes"}}, {})

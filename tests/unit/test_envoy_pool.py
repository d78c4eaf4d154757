"""`extproc envoy-config --pool`: Envoy as a gateway configures an InferencePool's endpoint picker, as data
(the protocol's parts each in its place) and as Envoy itself reads it (`envoy --mode validate`)."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from extproc.cli import main
from extproc.config import ConfigError, parse
from extproc.envoy_bootstrap import BootstrapOptions
from extproc.envoy_pool import BODY_MODES, PoolOptions, pool_bootstrap, render_pool
from extproc.localstack import VENV_BIN

PODS = ("10.0.0.1:8000", "10.0.0.2:8000")
EXT_PROC = "envoy.filters.http.ext_proc"


def parts(pool: PoolOptions) -> tuple[dict, dict, dict]:
    config = pool_bootstrap(BootstrapOptions(), pool)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f["typed_config"] for f in hcm["http_filters"] if f["name"] == EXT_PROC]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    return ext_proc, hcm, clusters


def test_the_pool_as_a_gateway_configures_it() -> None:
    ext_proc, hcm, clusters = parts(PoolOptions(pods=PODS))
    mode = ext_proc["processing_mode"]
    assert mode["request_body_mode"] == "FULL_DUPLEX_STREAMED" and mode["request_trailer_mode"] == "SEND"
    assert mode["response_header_mode"] == "SEND"  # the served endpoint comes back with them
    assert ext_proc["allow_mode_override"] is True and ext_proc["failure_mode_allow"] is False
    forwarded = ext_proc["metadata_options"]["forwarding_namespaces"]["untyped"]
    assert forwarded == ["envoy.lb.subset_hint", "envoy.lb"]
    assert "envoy.lb" in ext_proc["metadata_options"]["receiving_namespaces"]["untyped"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["retry_policy"]["num_retries"] == 2  # the pick, then two fallbacks
    lb = clusters["inference_pool"]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    sources = lb["typed_config"]["override_host_sources"]
    # the picker's metadata only: a client's x-gateway-destination-endpoint header is never followed
    assert sources == [{"metadata": {"key": "envoy.lb",
                                     "path": [{"key": "x-gateway-destination-endpoint"}]}}]
    served = lb["typed_config"]["selected_host_key"]["path"]
    assert served == [{"key": "x-gateway-destination-endpoint-served"}]
    endpoints = clusters["inference_pool"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints] == [8000, 8000]
    assert not [f for f in hcm["http_filters"] if "header_to_metadata" in f["name"]]  # no subset unless asked


def test_one_endpoint_means_no_retries_and_fail_open_is_the_pools_choice() -> None:
    ext_proc, hcm, _ = parts(PoolOptions(pods=PODS, fallback_endpoints=1, fail_open=True))
    assert "retry_policy" not in hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert ext_proc["failure_mode_allow"] is True


@pytest.mark.parametrize("mode", BODY_MODES)
def test_envoy_accepts_every_body_mode(tmp_path, mode: str) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(render_pool(BootstrapOptions(), PoolOptions(pods=PODS, body_mode=mode,
                                                                subset_from_header=True)))
    done = subprocess.run([str(VENV_BIN / "envoy"), "--mode", "validate", "-c", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_cli_writes_it_from_the_gateway_config(tmp_path, capsys) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"models": {"m": {"pods": [
        {"name": "a", "address": PODS[0]}, {"name": "b", "address": PODS[1]}]}},
        "gateway": {"fallback_endpoints": 2, "fail_open": True}}))
    assert main(["envoy-config", "--pool", "--gateway-config", str(config)]) == 0
    rendered = yaml.safe_load(capsys.readouterr().out)
    hcm = rendered["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f["typed_config"] for f in hcm["http_filters"] if f["name"] == EXT_PROC]
    # failing open, the body is buffered: Envoy fails open only before a full-duplex body has started
    assert ext_proc["failure_mode_allow"] is True
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["retry_policy"]["num_retries"] == 1
    assert main(["envoy-config", "--pool"]) == 1  # no endpoints named: refused


@pytest.mark.parametrize("value", [0, 17, "3", True, 2.5])
def test_a_bad_fallback_length_is_refused_by_name(value) -> None:
    with pytest.raises(ConfigError, match="gateway.fallback_endpoints"):
        parse({"models": {}, "gateway": {"fallback_endpoints": value}}, {})


def test_the_fallback_length_defaults_to_three() -> None:
    assert parse({"models": {}}, {}).fallback_endpoints == 3

import pytest

from extproc.config import ConfigError, parse

BASE = {"models": {"m": {"pods": [{"name": "p0", "address": "10.0.0.1:8000", "labels": {"gpu": "A100"}}]}}}


def test_defaults_and_pods():
    c = parse(BASE, {})
    assert c.default_strategy == "load-balance"
    assert c.destination_header == "x-gateway-destination-endpoint"
    (pod,) = c.pods
    assert (pod.model, pod.name, pod.address, pod.gpu) == ("m", "p0", "10.0.0.1:8000", "A100")
    assert pod.ready


def test_environment_overrides_file():
    c = parse({**BASE, "routing": {"default_strategy": "random"}},
              {"EXTPROC_DEFAULT_STRATEGY": "least-request", "EXTPROC_DESTINATION_HEADER": "Target-Pod",
               "EXTPROC_MAX_BODY_BYTES": "1024"})
    assert (c.default_strategy, c.destination_header) == ("least-request", "target-pod")
    assert c.max_body_bytes == 1024


def test_ipv6_address_is_bracketed():
    c = parse({"models": {"m": {"pods": [{"name": "p", "address": "[::1]:8000"}]}}}, {})
    assert c.pods[0].address == "[::1]:8000"


@pytest.mark.parametrize("raw,env", [
    ([], {}),
    ({"models": {"m": {"pods": [{"name": "p", "address": "pod.svc:8000"}]}}}, {}),  # hostname
    ({"models": {"m": {"pods": [{"name": "p", "address": "10.0.0.1"}]}}}, {}),  # no port
    ({"models": {"m": {"pods": [{"name": "p", "address": "10.0.0.1:0"}]}}}, {}),
    ({"models": {"m": {"pods": [{"name": "p", "address": "10.0.0.1:1"},
                                {"name": "p", "address": "10.0.0.2:1"}]}}}, {}),  # duplicate
    ({"models": {"m": {"pods": [{"address": "10.0.0.1:1"}]}}}, {}),
    ({**BASE, "routing": {"default_strategy": "nope"}}, {}),
    (BASE, {"EXTPROC_MAX_BODY_BYTES": "lots"}),
    ({**BASE, "gateway": {"destination_header": ":authority"}}, {}),
    ({**BASE, "gateway": {"destination_header": "host"}}, {}),
    ({**BASE, "gateway": {"destination_header": "x-envoy-original-dst-host"}}, {}),
    ({**BASE, "gateway": {"destination_header": "bad header"}}, {}),
    ({**BASE, "gateway": {"max_body_bytes": "lots"}}, {}),
    ({**BASE, "gateway": {"drain_timeout_seconds": "abc"}}, {}),
    ({**BASE, "gateway": {"model_paths": "/v1/chat/completions"}}, {}),
    ({"models": {"m": {"pods": [{"name": "p", "address": "10.0.0.1: 80"}]}}}, {}),
    ({"models": {"m": {"pods": [{"name": "p", "address": "10.0.0.1:80", "ready": "false"}]}}}, {}),
])
def test_invalid_configs_are_rejected(raw, env):
    with pytest.raises(ConfigError):
        parse(raw, env)

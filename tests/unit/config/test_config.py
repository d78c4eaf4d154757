import re

import pytest

from extproc.config import ConfigError, load, parse

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


@pytest.mark.parametrize("raw,names", [
    ({"modles": {}}, "modles"),  # a typo once meant "serve no models"
    ({**BASE, "gatway": {}}, "gatway"),
    ({**BASE, "gateway": {"max_body": 10}}, "gateway.max_body"),
    ({**BASE, "telemetry": {"refresh": 1}}, "telemetry.refresh"),
    ({**BASE, "redis": {"uri": "redis://x"}}, "redis.uri"),
    ({"models": {"m": {"pods": [], "routingconfig": {}}}}, "models.m.routingconfig"),
    ({"models": {"m": {"pods": [{"name": "p", "address": "10.0.0.1:80", "raedy": False}]}}},
     "models.m.pods[0].raedy"),
    ({}, "models"),
    ({**BASE, "gateway": {"max_body_bytes": 64 * 1024 * 1024}}, "max_body_bytes"),  # over Envoy's buffer
    ({**BASE, "gateway": {"model_paths": ["/sim/faults", "/"]}}, "model_paths"),
    ({"models": {"m": {"pods": [{"name": "p", "address": "0.0.0.0:9901"}]}}}, "address"),
    ({"models": {"m": {"pods": [{"name": "p", "address": "[::]:8000"}]}}}, "address"),
    ({"models": {"m": {"pods": [{"name": "p", "address": "224.0.0.1:8000"}]}}}, "address"),
    ({**BASE, "gateway": {"api_keys_file": "/nonexistent/keys"}}, "gateway.api_keys_file"),
])
def test_errors_name_the_key_at_fault(raw, names):
    with pytest.raises(ConfigError, match=re.escape(names)):
        parse(raw, {})


def test_an_empty_file_is_refused(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        load(path, {})
    path.write_text("models: {m: {pods: [{name: p, address: '10.0.0.1:80'}]}}\n")
    assert load(path, {}).models == ("m",)


def test_check_config_prints_what_would_be_served_or_the_error(tmp_path, capsys):
    from extproc.cli import main

    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("models: {m: {pods: [{name: p0, address: '10.0.0.1:8000', labels: {gpu: L20}}]}}\n")
    bad.write_text("models: {m: {pods: [{name: p0, address: '10.0.0.1:8000', raedy: false}]}}\n")
    assert main(["check-config", str(good)]) == 0
    out = capsys.readouterr().out
    assert "model m: 1 pod(s)" in out and "10.0.0.1:8000" in out and "gpu=L20" in out
    assert main(["check-config", str(bad)]) == 1
    assert "models.m.pods[0].raedy" in capsys.readouterr().err


def test_check_config_finds_redis_where_serve_does(tmp_path, capsys, monkeypatch):
    from extproc.cli import main

    path = tmp_path / "g.yaml"
    path.write_text("models: {m: {pods: [{name: p0, address: '10.0.0.1:8000'}]}}\n")
    for name in ("EXTPROC_REDIS_URL", "REDIS_HOST", "REDIS_PORT", "REDIS_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    assert main(["check-config", str(path)]) == 0
    assert "Redis: off" in capsys.readouterr().out
    # AIBrix's variables, as `serve` honours them; the password never printed
    monkeypatch.setenv("REDIS_HOST", "redis.example")
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret")
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Redis: on (redis://" in out and "redis.example:6379" in out and "s3cret" not in out


def test_redis_sync_timing_is_read_and_liveness_follows_the_heartbeat(tmp_path):
    from extproc.config import load
    from extproc.config.schema import RedisSync

    path = tmp_path / "gateway.yaml"
    path.write_text("models: {m: {pods: [{name: p, address: '10.0.0.1:80'}]}}\n"
                    "redis: {sync_interval_seconds: 0.25, heartbeat_seconds: 2, timeout_seconds: 1.5, "
                    "aibrix_rows: true}\n")
    sync = load(path, {}).redis_sync
    assert sync == RedisSync(0.25, 2.0, 1.5, True) and sync.gateway_ttl == 6.0
    path.write_text("models: {m: {pods: [{name: p, address: '10.0.0.1:80'}]}}\n")
    assert load(path, {}).redis_sync == RedisSync(0.1, 1.0, 0.5, False)  # the defaults

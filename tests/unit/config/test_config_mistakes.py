"""Configs that are wrong are refused whole, naming the key and its line, with the same message from
`extproc check-config` and from a reload (issue 33: these were accepted, or named vaguely)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from extproc.cli import main
from extproc.config import ConfigError, load
from extproc.server.app import ConfigWatcher

GOOD = "models: {m: {pods: [{name: p, address: '10.0.0.1:80'}]}}\n"

MISTAKES = [
    ("models twice: the first block's pods were dropped", """\
models:
  a: {pods: [{name: a0, address: '10.0.0.1:80'}]}
routing: {default_strategy: random}
models:
  b: {pods: [{name: b0, address: '10.0.0.2:80'}]}
""", "duplicate key models (line 4; first at line 1): YAML would keep only the last"),
    ("a pod with two addresses", """\
models:
  m:
    pods:
      - name: p0
        address: 10.0.0.1:80
        address: 10.0.0.2:80
""", "duplicate key models.m.pods[0].address (line 6; first at line 5)"),
    ("routing twice at the top", """\
routing: {default_strategy: random}
models: {m: {pods: [{name: p0, address: '10.0.0.1:80'}]}}
routing: {default_strategy: least-request}
""", "duplicate key routing (line 3; first at line 1)"),
    ("a repeated key deep in a flow mapping", """\
models: {m: {pods: [{name: p0, address: '10.0.0.1:80', labels: {gpu: A100, gpu: L20}}]}}
""", "duplicate key models.m.pods[0].labels.gpu (line 1; first at line 1)"),
    ("two pods, one address", """\
models:
  m:
    pods:
      - {name: p0, address: '10.0.0.1:80'}
      - {name: p1, address: '10.0.0.1:80'}
""", "models.m.pods[1].address 10.0.0.1:80 (line 5) is also pods[0]'s: one engine would be counted as "
     "two pods"),
    ("two pods, one address written two ways", """\
models:
  m:
    pods:
      - {name: p0, address: '[::1]:80'}
      - {name: p1, address: '[0:0::1]:80'}
""", "models.m.pods[1].address [::1]:80 (line 5) is also pods[0]'s"),
    ("two pods, one name", """\
models:
  m:
    pods:
      - {name: p0, address: '10.0.0.1:80'}
      - {name: p0, address: '10.0.0.2:80'}
""", "models.m.pods[1].name 'p0' (line 5) is also pods[0]'s: a pod's name must be unique in its model"),
    ("a misspelt pod key", """\
models:
  m:
    pods:
      - {name: l20-0, adress: '10.0.0.1:80'}
""", "unknown key models.m.pods[0].adress (line 4); did you mean address? (known: address, deployment, "),
    ("a misspelt flag", """\
models:
  m:
    pods:
      - name: p0
        address: 10.0.0.1:80
        raedy: false
""", "unknown key models.m.pods[0].raedy (line 6); did you mean ready?"),
    ("a misspelt section", """\
modles: {m: {pods: [{name: p0, address: '10.0.0.1:80'}]}}
""", "unknown key modles (line 1); did you mean models?"),
    ("a key like nothing known", """\
models: {m: {pods: [{name: p0, address: '10.0.0.1:80', zzz: 1}]}}
""", "unknown key models.m.pods[0].zzz (line 1) (known: "),
    ("a Redis timeout past the liveness window", GOOD + """\
redis: {heartbeat_seconds: 0.2, timeout_seconds: 0.6}
""", "redis.sync_interval_seconds + redis.timeout_seconds (0.7) must stay below the liveness window, "
     "3 x redis.heartbeat_seconds (0.6)"),
    ("a heartbeat shorter than the sync interval", GOOD + """\
redis: {sync_interval_seconds: 2, heartbeat_seconds: 1}
""", "redis.heartbeat_seconds 1 is below redis.sync_interval_seconds 2"),
    ("a zero sync interval", GOOD + """\
redis: {sync_interval_seconds: 0}
""", "redis.sync_interval_seconds must be a number >= 0.01, not 0"),
    ("AIBrix rows as a string", GOOD + """\
redis: {aibrix_rows: 'yes'}
""", "redis.aibrix_rows must be true or false, not 'yes'"),
    ("a misspelt Redis key", GOOD + """\
redis: {timeout_secs: 1}
""", "unknown key redis.timeout_secs (line 2); did you mean timeout_seconds?"),
    ("a misspelt routing key", GOOD + """\
routing:
  default_stratgy: random
""", "unknown key routing.default_stratgy (line 3); did you mean default_strategy?"),
    ("a misspelt load-balance knob", GOOD + """\
routing:
  load_balance: {queued_wieght: 2}
""", "unknown key routing.load_balance.queued_wieght (line 3); did you mean queued_weight?"),
    ("a misspelt rate-limit key", GOOD + """\
rate_limits:
  requests_per_minute: 60
  tokens_per_minit: 1000
""", "unknown key rate_limits.tokens_per_minit (line 4); did you mean tokens_per_minute?"),
    ("a misspelt key in a rate-limit override", GOOD + """\
rate_limits:
  overrides:
    - {model: m, requests_per_minut: 5}
""", "unknown key rate_limits.overrides[0].requests_per_minut (line 4); did you mean requests_per_minute?"),
]


@pytest.mark.parametrize(("text", "message"), [(t, m) for _, t, m in MISTAKES],
                         ids=[what for what, _, _ in MISTAKES])
def test_a_wrong_config_is_refused_with_one_message_from_check_config_and_reload(
        text: str, message: str, tmp_path: Path, capsys, caplog):
    path = tmp_path / "gateway.yaml"
    with pytest.raises(ConfigError) as refused:
        path.write_text(text)
        load(path, {})
    error = str(refused.value)
    assert message in error

    assert main(["check-config", str(path)]) == 1
    assert capsys.readouterr().err.strip() == f"{path}: {error}"

    applied: list = []
    gateway = type("G", (), {"apply": lambda self, config: applied.append(config)})()
    _write(path, GOOD, 1)
    watcher = ConfigWatcher(path, gateway, CollectorRegistry())  # serving GOOD
    _write(path, text, 2)
    with caplog.at_level(logging.ERROR):
        assert watcher.check() is False and watcher.check() is False  # held still, then refused
    assert applied == []  # the old config keeps serving
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(logged) == 1 and logged[0].endswith(f"keeping the previous one: {error}"), logged


def _write(path: Path, text: str, second: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(second * 10**9, second * 10**9))

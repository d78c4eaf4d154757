"""The config watcher applies a change once the file holds still, and refuses a bad one whole."""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import CollectorRegistry

from extproc.server.app import ConfigWatcher

GOOD = "models: {m: {pods: [{name: p, address: '10.0.0.1:80'}, {name: q, address: '10.0.0.2:80'}]}}\n"


class FakeGateway:
    def __init__(self) -> None:
        self.applied = []

    def apply(self, config) -> None:
        self.applied.append(config)


def write(path: Path, text: str, stamp: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(stamp, stamp))  # distinct mtimes without waiting for the clock


def test_a_change_applies_once_the_file_holds_still_and_a_bad_one_is_counted(tmp_path: Path):
    path = tmp_path / "gateway.yaml"
    write(path, GOOD, 1_000_000_000)
    gw, registry = FakeGateway(), CollectorRegistry()
    watcher = ConfigWatcher(path, gw, registry)
    write(path, GOOD[:40], 2_000_000_000)  # caught half-written
    assert watcher.check() is False
    write(path, GOOD.replace("10.0.0.2", "10.0.0.3"), 3_000_000_000)  # the write completes
    assert watcher.check() is False and gw.applied == []  # still moving: wait
    assert watcher.check() is True
    assert [p.address for p in gw.applied[0].pods] == ["10.0.0.1:80", "10.0.0.3:80"]
    assert watcher.check() is False  # nothing new

    write(path, "modles: {}\n", 4_000_000_000)
    assert watcher.check() is False and watcher.check() is False
    assert len(gw.applied) == 1
    assert registry.get_sample_value("extproc_config_reload_errors_total") == 1.0

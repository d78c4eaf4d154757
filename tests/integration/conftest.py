from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.stack import Stack, running_upstreams

MODEL = "llama2-7b"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def upstreams(log_dir: Path) -> Iterator[dict[str, int]]:
    """Two local upstreams: `a` is the model's pod, `b` is a port no route should ever reach."""
    with running_upstreams(log_dir) as ports:
        yield ports


@pytest.fixture(scope="module")
def stack(log_dir: Path, upstreams: dict[str, int]) -> Iterator[Stack]:
    s = Stack(config_path=log_dir / "gateway.yaml", log_dir=log_dir)
    s.write_config({
        "models": {
            MODEL: {"pods": [{"name": "a100-0", "address": f"127.0.0.1:{upstreams['a']}",
                              "deployment": "llama2-7b-a100", "labels": {"gpu": "A100"}}]},
            "no-pods-model": {"pods": []},
        },
        "routing": {"default_strategy": "least-request"},
        "gateway": {"max_body_bytes": 64 * 1024},
    })
    s.start_gateway()
    s.start_envoy()
    yield s
    s.stop()

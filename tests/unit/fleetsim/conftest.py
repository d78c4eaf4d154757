"""Small fleets that run in well under a second each."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.fleetsim.scenario import Scenario, parse

CHAT = {"name": "chat", "rate": 20, "prompt": {"mean": 200, "sigma": 0.8, "max": 2000},
        "output": {"mean": 60, "sigma": 0.8, "max": 400}}


def small(**overrides: Any) -> Scenario:
    raw: dict[str, Any] = {
        "name": "small", "model": "llama3-8b", "duration_s": 12, "warmup_s": 2,
        "fleet": [{"gpu": "L20", "replicas": 2, "name": "slow"}, {"gpu": "A100", "replicas": 2, "name": "fast"}],
        "streams": [CHAT], "slo": {"tpot_s": 0.05},
    }
    raw.update(overrides)
    return parse(raw)


@pytest.fixture
def scenario() -> Scenario:
    return small()

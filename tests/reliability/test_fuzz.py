"""A few thousand coverage-guided inputs per fuzz target (tests/reliability/fuzz.py) on every run of
the suite; `make fuzz` runs them for minutes. A crash keeps its input in the test's tmp dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

RUNS = 5000 * int(os.environ.get("RELIABILITY_SCALE", "1"))
SEEDS = [
    {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "stream": True,
     "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
    {"model": "m", "stream": True, "stream_options": {"include_usage": False}, "prompt": "ab",
     "max_tokens": 5},
    {"model": "m", "prompt": ["a", "b"], "stream": True},
    {"model": "m", "input": "embed me"},
]
CONFIG_SEED = "models:\n  m:\n    pods:\n      - {name: a, address: 127.0.0.1:8001, labels: {gpu: L20}}\n" \
              "routing: {default_strategy: least-request}\ngateway: {max_body_bytes: 1024}\n"


def corpus(tmp_path: Path, target: str) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    if target == "body":
        for i, seed in enumerate(SEEDS):
            (d / str(i)).write_bytes(bytes([i % 3]) + json.dumps(seed).encode())
    elif target == "strategy":
        for i, seed in enumerate(["load-balance", "prefix-cache:5,load-balance:4", "random:0,least-request"]):
            (d / str(i)).write_text(seed)
    else:
        (d / "0").write_text(CONFIG_SEED)
    return d


@pytest.mark.parametrize("target", ["body", "strategy", "config"])
def test_fuzz_target_survives(tmp_path: Path, target: str):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.reliability.fuzz", target, f"-runs={RUNS}", "-max_len=4096",
         f"-artifact_prefix={tmp_path}/", str(corpus(tmp_path, target))],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"Done {RUNS} runs" in proc.stderr

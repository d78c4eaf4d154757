"""The optimizer's YAML deployment list, and the CLI's one-shot plan."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from extproc.cli import main
from extproc.gpu_profiles import dump_profile
from extproc.optimizer.deployments import (
    ConfigError,
    Deployment,
    FileDeploymentSource,
    load_config,
    parse_config,
)
from tests.support.shared_data import A40_PROFILE
from tests.unit.optimizer.support import profile

A40 = A40_PROFILE


def test_fields_and_kubernetes_labels(tmp_path: Path) -> None:
    cfg = parse_config(
        {
            "profiles": ["p/a.json"],
            "deployments": [
                {"name": "a", "model": "m", "min_replicas": 1, "replicas": 3},
                {
                    "name": "b",
                    "namespace": "ml",
                    "labels": {"model.aibrix.ai/name": "m", "model.aibrix.ai/min_replicas": "2"},
                },
            ],
        },
        tmp_path,
    )
    assert cfg.deployments == (Deployment("default", "a", "m", 1, 3), Deployment("ml", "b", "m", 2, None))
    assert cfg.profiles == (tmp_path / "p/a.json",)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"deployments": [{"name": "a"}]}, r"deployments\[0\]\.model"),
        ({"deployments": [{"name": "a/b", "model": "m"}]}, r"deployments\[0\]\.name"),
        (
            {"deployments": [{"name": "a", "model": "m", "min_replicas": -1}]},
            r"deployments\[0\]\.min_replicas",
        ),
        ({"deployments": [{"name": "a", "model": "m"}, {"name": "a", "model": "n"}]}, "listed twice"),
        ({"deployments": {}}, "deployments: expected a list"),
        ({"deploymets": []}, "unknown key deploymets; did you mean deployments"),
        ({"profiles": "a.json"}, "profiles"),
    ],
)
def test_bad_configs(data: object, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(data, tmp_path)


async def test_file_source_reloads_and_refuses_bad_edits(tmp_path: Path) -> None:
    path = tmp_path / "opt.yaml"
    path.write_text(yaml.safe_dump({"deployments": [{"name": "a", "model": "m"}]}))
    source = FileDeploymentSource(path)
    assert [d.name for d in await source.deployments()] == ["a"]
    path.write_text(
        yaml.safe_dump({"deployments": [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}]})
    )
    os.utime(path, ns=(1, 10**18))  # a distinct mtime, whatever the clock's resolution
    assert [d.name for d in await source.deployments()] == ["a", "b"]
    path.write_text("deployments: [{name: c}]")
    os.utime(path, ns=(1, 2 * 10**18))
    assert [d.name for d in await source.deployments()] == ["a", "b"]  # refused: the last good list stays
    with pytest.raises(ConfigError, match="opt.yaml"):
        load_config(path)


def test_optimize_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, short, long in (("a", 10, 1), ("b", 2, 5)):
        (tmp_path / f"{name}.json").write_text(json.dumps(dump_profile(profile(name, 1.0, short, long))))
    (tmp_path / "w.json").write_text(
        json.dumps(
            {
                "rates": [
                    {"input_tokens": 128, "output_tokens": 16, "rps": 20},
                    {"input_tokens": 2048, "output_tokens": 512, "rps": 10},
                ]
            }
        )
    )
    assert (
        main(
            [
                "optimize",
                "--profile",
                str(tmp_path / "a.json"),
                "--profile",
                str(tmp_path / "b.json"),
                "--workload",
                str(tmp_path / "w.json"),
                "--json",
                "--headroom",
                "0",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["replicas"] == {"a": 2, "b": 2} and out["cost"] == 4.0 and 0 <= out["solve_seconds"] < 1


def test_optimize_cli_on_aibrix_profile_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "w.json").write_text(
        json.dumps({"rates": [{"input_tokens": 128, "output_tokens": 8, "rps": 100}]})
    )
    args = ["optimize", "--profile", str(A40), "--workload", str(tmp_path / "w.json")]
    assert main([*args, "--headroom", "0"]) == 0
    out = capsys.readouterr().out
    # cell [1][0] of AIBrix's A40 profile: 49.18 req/s per replica -> 3 replicas for 100 req/s at 0.3 each
    assert "simulator-llama2-7b-a40         3" in out and "total cost 0.9 " in out
    # by default the service's headroom, 0.5 x sqrt(load) (no e2e: one request per replica at a time):
    # 120 req/s is 2.44 replicas' worth, 3 at the mean, 2.44 + 0.78 -> 4 with headroom
    (tmp_path / "w.json").write_text(
        json.dumps({"rates": [{"input_tokens": 128, "output_tokens": 8, "rps": 120}]})
    )
    assert main([*args, "--headroom", "0"]) == 0
    assert "simulator-llama2-7b-a40         3" in capsys.readouterr().out
    assert main(args) == 0
    assert "simulator-llama2-7b-a40         4" in capsys.readouterr().out


def test_optimize_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "w.json").write_text(
        json.dumps({"rates": [{"input_tokens": 4096, "output_tokens": 512, "rps": 1}]})
    )
    (tmp_path / "a.json").write_text(json.dumps(dump_profile(profile("a", 1.0, 10, 0))))
    assert (
        main(["optimize", "--profile", str(tmp_path / "a.json"), "--workload", str(tmp_path / "w.json")]) == 2
    )
    assert "no GPU type can serve these cells" in capsys.readouterr().err
    (tmp_path / "a.json").write_text("{}")
    assert (
        main(["optimize", "--profile", str(tmp_path / "a.json"), "--workload", str(tmp_path / "w.json")]) == 2
    )
    assert "a.json: gpu: missing" in capsys.readouterr().err


def test_planning_section_and_max_replicas(tmp_path: Path) -> None:
    from extproc.optimizer.policy import PlanPolicy

    path = tmp_path / "opt.yaml"
    path.write_text("planning:\n  headroom: 0.75\n  add_cost: 0.3\n  feedback_span_s: 60\n"
                    "deployments:\n  - {name: a, model: m, max_replicas: 8}\n"
                    "  - {name: b, model: m, labels: {model.aibrix.ai/max_replicas: '3'}}\n")
    cfg = load_config(path)
    assert cfg.policy == PlanPolicy(headroom=0.75, add_cost=0.3, feedback_span_s=60.0)
    assert [d.max_replicas for d in cfg.deployments] == [8, 3]
    # derived defaults follow the schedule: add provision/window, span window/2, settle provision + 3 ticks
    resolved = PlanPolicy(provision_s=120).resolved(interval_s=20, window_s=480)
    assert (resolved.add_cost, resolved.feedback_span_s, resolved.feedback_settle_s) == (0.25, 240.0, 180.0)
    fb = resolved.feedback()
    assert (fb.span_s, fb.settle_s, fb.gain, fb.ceiling) == (240.0, 180.0, 5.0, 2.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("planning:\n  headrom: 1\n", r"unknown key planning\.headrom \(line 2\); did you mean headroom\?"),
        ("planning:\n  x: 1\n  feedback_gain: -1\n", r"planning\.x \(line 2\)"),
        ("planning:\n  feedback_gain: 0\n", r"planning\.feedback_gain \(line 2\): expected a number > 0"),
        ("planning:\n  feedback_ceiling: 0.5\n",
         r"planning\.feedback_ceiling \(line 2\): expected a number >= 1"),
        ("planning:\n  remove_cost: true\n", r"planning\.remove_cost"),
        ("planning: [1]\n", "planning \\(line 1\\): expected a mapping"),
        ("deployments:\n  - {name: a, model: m, min_replicas: 3, max_replicas: 2}\n",
         r"deployments\[0\]\.max_replicas \(line 2\): 2 is below min_replicas 3"),
        ("planning:\n  headroom: 1\n  headroom: 2\n", "headroom"),  # a repeated key is refused too
        ("kubernetes:\n  autoscalers: [hpa, keda]\n",
         r"kubernetes\.autoscalers \(line 2\): expected a list of hpa, podautoscaler"),
        ("kubernetes:\n  autoscaler: [hpa]\n", "did you mean autoscalers"),
    ],
)
def test_bad_planning_is_refused_whole_naming_the_key(text: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "opt.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)

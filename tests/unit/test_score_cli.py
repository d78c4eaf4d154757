import json

import pytest

from extproc.cli import build_parser
from extproc.score_cli import score

WORKED = [{"name": "A100", "running": 20, "queued": 0, "tokens_per_s": 4000, "kv_free": 0.30},
          {"name": "L20", "running": 25, "queued": 0, "tokens_per_s": 3000, "kv_free": 0.60},
          {"name": "B100", "running": 30, "queued": 0, "tokens_per_s": 6000, "kv_free": 0.50}]


def run(tmp_path, pods, *args):
    path = tmp_path / "pods.json"
    path.write_text(json.dumps(pods))
    parsed = build_parser().parse_args(["score", "--pods", str(path), *args])
    return parsed.func(parsed)


def test_the_specs_worked_example(tmp_path, capsys):
    assert run(tmp_path, WORKED, "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"] == "B100"
    assert {k: round(v, 4) for k, v in out["scores"].items()} == {"A100": 0.0099, "L20": 0.0110, "B100": 0.0075}


def test_table(tmp_path, capsys):
    assert run(tmp_path, WORKED, "--strategy", "load-balance") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "strategy: load-balance" and "lower is better" in lines[1]
    assert [line.split()[:2] for line in lines[2:5]] == [["A100", "0.0099"], ["L20", "0.0110"], ["B100", "0.0075"]]
    assert lines[4].endswith("<- chosen") and lines[-1] == "chosen: B100"


def test_inf_is_the_string_inf_and_null_means_no_estimate(tmp_path, capsys):
    pods = [{"name": "full", "running": 1, "tokens_per_s": 1000, "kv_free": 0.05},
            {"name": "new", "running": 2, "tokens_per_s": None, "kv_free": None, "cpu_kv_usage": 0.2},
            {"name": "old", "running": 4, "tokens_per_s": 3000, "kv_free": 1.0}]
    assert run(tmp_path, pods, "--json") == 0
    out = json.loads(capsys.readouterr().out)
    # "new" is scored at the mean capacity (2000) with no KV penalty
    assert out == {"chosen": "new", "scores": {"full": "inf", "new": 0.001, "old": pytest.approx(4 / 3000)}}


def test_blends_and_the_gate_show_what_routing_does(monkeypatch):
    pods = [{"name": "a", "running": 0, "tokens_per_s": 1000}, {"name": "b", "running": 30, "tokens_per_s": 1000}]
    result = score(pods, "least-request", {})
    assert result.routed_as == "least-request:1,load-balance:1"
    assert result.excluded == ["b"] and result.chosen == "a" and list(result.scores) == ["a"]
    # knobs come from the environment, as in the gateway
    assert score(pods, None, {"AIBRIX_LOAD_BALANCE_IMBALANCE_MIN_GAP": "100"}).excluded == []


@pytest.mark.parametrize("pods,args", [
    ([], []),
    ([{"running": 1}], []),
    ([{"name": "a", "kv_free": 1.5}], []),
    ([{"name": "a", "running": -1}], []),
    ([{"name": "a"}, {"name": "a"}], []),
    (WORKED, ["--strategy", "load-balance:0"]),
    (WORKED, ["--strategy", "fastest"]),
])
def test_bad_input_exits_2_with_a_message(tmp_path, capsys, pods, args):
    assert run(tmp_path, pods, *args) == 2
    assert capsys.readouterr().err.startswith("extproc score: ")


def test_a_nearly_full_idle_pod_beside_a_busy_healthy_one(tmp_path, capsys):
    """The issue's reproduction: the gate used to exclude "healthy" and leave only "full" (5 % free)."""
    pods = [{"name": "full", "running": 0, "tokens_per_s": 1000, "kv_free": 0.05},
            {"name": "healthy", "running": 20, "tokens_per_s": 1000, "kv_free": 0.6}]
    assert run(tmp_path, pods, "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"] == "healthy" and "excluded" not in out and out["scores"]["full"] == "inf"


def test_every_pod_critical_the_most_kv_headroom_wins_gate_on(tmp_path, capsys):
    pods = [{"name": "idle", "running": 0, "tokens_per_s": 1000, "kv_free": 0.02},
            {"name": "busy", "running": 20, "tokens_per_s": 1000, "kv_free": 0.08}]
    assert run(tmp_path, pods, "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"chosen": "busy", "scores": {"idle": "inf", "busy": "inf"}}
    # blended, the gate still does not drop the pod with the most headroom
    assert score(pods, "least-request", {}).excluded == []

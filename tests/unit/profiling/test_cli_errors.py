"""`extproc benchmark`'s refusals that come before any request: one line naming what is wrong, exit 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.cli import main


def profile(tmp_path: Path, slos: dict[str, float]) -> Path:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"gpu": "a100", "cost": 1.0, "tputs": [[2.0]], "indexes": [[64], [512]],
                                "e2e": [[1.0]], "slos": slos, "created": 1.0}))
    return path


@pytest.mark.parametrize("slos, max_budget, error", [
    ({"percentile": 99, "tpot": 0.05}, "0", "--max-budget must be at least 1"),
    ({"percentile": 95, "tpot": 0.05}, "64", "slos: percentile must be one of"),
    ({"percentile": 99, "itl": 0.05}, "64", "slos: unknown SLO 'itl'"),
    ({}, "64", "names no SLO to climb against"),
])
def test_a_climb_the_profile_cannot_judge_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    slos: dict[str, float], max_budget: str,
                                                    error: str) -> None:
    # the endpoint is never contacted: nothing listens there
    code = main(["benchmark", "-m", "m", "--endpoint", "http://127.0.0.1:9", "-o", str(tmp_path / "o.jsonl"),
                 "--admitted", str(profile(tmp_path, slos)), "--max-budget", max_budget])
    err = capsys.readouterr().err
    assert code == 1 and error in err and "Traceback" not in err, err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("extra, error", [
    ([], "--budget-margin needs --admitted"),
    (["--admitted", "ADMITTED"], "--budget-margin must be a number >= 1"),
])
def test_gen_profile_refuses_a_budget_margin_it_cannot_use(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         extra: list[str], error: str) -> None:
    bench = tmp_path / "b.jsonl"
    bench.write_text("")  # never read: the flag is refused first
    extra = [str(tmp_path / "a.jsonl") if x == "ADMITTED" else x for x in extra]
    margin = "0.5" if extra else "2"
    code = main(["gen-profile", "d", "--benchmark", str(bench), "--cost", "1", "--tpot", "0.05",
                 "--budget-margin", margin, "-o", str(tmp_path / "p.json"), *extra])
    err = capsys.readouterr().err
    assert code == 1 and error in err and "Traceback" not in err, err
    assert not (tmp_path / "p.json").exists()

"""`extproc benchmark` against the engine simulator over real sockets → `extproc gen-profile` → the profile
loader; Redis output to a real redis-server; the errors users meet. Kept to a few small cells."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from extproc.gpu_profiles import load_profile, parse_profile
from extproc.localstack import Proc, free_port, wait_until
from tests.integration.sim_fixtures import SimProcess, start_sim
from tests.support.shared_data import AIBRIX_DATA

pytestmark = pytest.mark.integration

MODEL = "llama2-7b"
SECRET = "sk-never-print-me-42"
REDIS_PASSWORD = "s3cret-redis-pw"
CELLS = ["--input-lens", "128,512", "--output-lens", "16", "--rates", "8,32", "--num-prompts", "20"]


def extproc(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extproc", *args], capture_output=True, text=True,
                          timeout=timeout)


def jsonl(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiling")


@pytest.fixture(scope="module")
def fast_sim(log_dir: Path) -> Iterator[SimProcess]:
    sim = start_sim(["--gpu", "A100-80GB", "--model", MODEL, "--time-scale", "50"], log_dir)
    yield sim
    sim.stop()


@pytest.fixture(scope="module")
def slow_sim(log_dir: Path) -> Iterator[SimProcess]:
    sim = start_sim(["--gpu", "V100", "--model", MODEL, "--time-scale", "5"], log_dir)
    yield sim
    sim.stop()


@pytest.fixture(scope="module")
def benchmarks(log_dir: Path, fast_sim: SimProcess, slow_sim: SimProcess) -> dict[str, tuple[Path, str]]:
    """Both engines benchmarked at once (two processes): the same cells, the same seed."""
    runs = {}
    for name, sim in (("fast", fast_sim), ("slow", slow_sim)):
        out = log_dir / f"{name}.jsonl"
        runs[name] = (out, subprocess.Popen(
            [sys.executable, "-m", "extproc", "benchmark", "-m", MODEL, "--endpoint", sim.url, "-o", str(out),
             "--api-key", SECRET, *CELLS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = {}
    for name, (out, proc) in runs.items():
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        results[name] = (out, stdout + stderr)
    return results


@pytest.fixture(scope="module")
def redis_server(log_dir: Path) -> Iterator[int]:
    port = free_port()
    proc = Proc("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--requirepass", REDIS_PASSWORD], log_dir)
    client = redis.Redis(port=port, password=REDIS_PASSWORD, socket_timeout=1)
    proc.wait_ready(lambda: bool(client.ping()), timeout=20)
    yield port
    client.close()
    proc.stop()


def test_benchmark_writes_aibrix_lines_for_every_cell(benchmarks: dict[str, tuple[Path, str]]) -> None:
    path, output = benchmarks["fast"]
    lines = jsonl(path)
    assert len(lines) == 2 * 2 * 5  # inputs × rates × metrics
    assert [line["metric"] for line in lines[:5]] == ["TPUT", "TT", "E2E", "TTFT", "TPOT"]
    cells = {(line["input_tokens"], line["output_tokens"], line["request_rate"]) for line in lines}
    assert cells == {(128, 16, 8.0), (128, 16, 32.0), (512, 16, 8.0), (512, 16, 32.0)}
    for line in lines:
        assert line["model"] == MODEL and line["samples"] == 20 and line["failed"] == 0
        if line["metric"] == "TT":  # exactly 16 tokens per request: TT = 16 × TPUT
            tput = next(x["mean"] for x in lines if x["metric"] == "TPUT" and x["input_tokens"] ==
                        line["input_tokens"] and x["request_rate"] == line["request_rate"])
            assert line["mean"] == pytest.approx(16 * tput)
        if line["metric"] in ("E2E", "TTFT"):
            assert 0 < line["mean"] < 5 and line["P50"] <= line["P90"] <= line["P99"]
    assert SECRET not in output and "4 cells written" in output


def test_gen_profile_from_the_benchmark_loads_and_ranks_the_engines(
        benchmarks: dict[str, tuple[Path, str]], log_dir: Path) -> None:
    profiles = {}
    for name, (path, _) in benchmarks.items():
        out, png = log_dir / f"{name}.json", log_dir / f"{name}.png"
        result = extproc("gen-profile", f"llama2-7b-{name}", "--benchmark", str(path), "--cost", "1.5",
                         "-o", str(out), "--plot", str(png))
        assert result.returncode == 0, result.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        profiles[name] = load_profile(out)
    fast, slow = profiles["fast"], profiles["slow"]
    assert fast.gpu == "llama2-7b-fast" and fast.cost == 1.5
    assert fast.outputs == (16,) and fast.inputs == (128, 512)
    assert fast.slos == {"percentile": 0}
    assert all(v > 0 for row in slow.tputs for v in row)
    # the faster engine (A100 at 50×) completes more per second and answers sooner than V100 at 5×
    for row_f, row_s in zip(fast.tputs, slow.tputs):
        assert all(f > s for f, s in zip(row_f, row_s))
    for row_f, row_s in zip(fast.e2e, slow.e2e):
        assert all(0 < 5 * f < s for f, s in zip(row_f, row_s))


def test_gen_profile_to_redis_under_aibrix_key(benchmarks: dict[str, tuple[Path, str]],
                                               redis_server: int) -> None:
    path, _ = benchmarks["fast"]
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_server}/2?model={MODEL}"
    result = extproc("gen-profile", "llama2-7b-a100", "--benchmark", str(path), "--cost", "2",
                     "--e2e", "1.0", "--ttft", "0.5", "--percentile", "99", "-o", url)
    assert result.returncode == 0, result.stderr
    assert REDIS_PASSWORD not in result.stdout + result.stderr
    stored = redis.Redis(port=redis_server, db=2, password=REDIS_PASSWORD).get(
        f"aibrix:profile_{MODEL}_llama2-7b-a100")
    assert stored is not None
    profile = parse_profile(json.loads(stored))
    assert profile.gpu == "llama2-7b-a100" and profile.cost == 2.0
    assert profile.slos == {"percentile": 99, "e2e": 1.0, "ttft": 0.5}
    assert profile.ttft is not None and all(0 < v < 0.5 for row in profile.ttft for v in row)


@pytest.mark.parametrize("url, message", [
    (f"redis://:{REDIS_PASSWORD}@127.0.0.1:{{port}}/0", "?model=MODEL"),
    (f"redis://:wrong-{REDIS_PASSWORD}@127.0.0.1:{{port}}/0?model=m", "cannot store the profile"),
])
def test_redis_errors_are_clear_and_hide_the_password(benchmarks: dict[str, tuple[Path, str]],
                                                     redis_server: int, url: str, message: str) -> None:
    path, _ = benchmarks["fast"]
    result = extproc("gen-profile", "d", "--benchmark", str(path), "--cost", "1",
                     "-o", url.format(port=redis_server))
    assert result.returncode != 0 and message in result.stderr
    assert REDIS_PASSWORD not in result.stdout + result.stderr


def test_failed_requests_are_counted_per_cell(log_dir: Path) -> None:
    sim = start_sim(["--gpu", "A100-80GB", "--model", MODEL, "--time-scale", "50", "--error-rate", "0.3",
                     "--seed", "3"], log_dir)
    try:
        out = log_dir / "errors.jsonl"
        result = extproc("benchmark", "-m", MODEL, "--endpoint", sim.url, "-o", str(out),
                         "--input-lens", "64",
                         "--output-lens", "8", "--rates", "40", "--num-prompts", "40")
    finally:
        sim.stop()
    assert result.returncode == 0, result.stderr
    lines = jsonl(out)
    failed = lines[0]["failed"]
    assert 0 < failed < 40 and all(line["failed"] == failed for line in lines)
    assert lines[0]["mean"] < 40  # TPUT counts successes only
    assert f"{40 - failed} ok, {failed} failed" in result.stderr and "HTTP 500" in result.stderr


def test_a_cell_that_cannot_keep_up_is_cut_off_and_higher_rates_skipped(log_dir: Path) -> None:
    sim = start_sim(["--gpu", "V100", "--model", MODEL, "--time-scale", "1"], log_dir)
    try:
        out = log_dir / "overload.jsonl"
        result = extproc("benchmark", "-m", MODEL, "--endpoint", sim.url, "-o", str(out),
                         "--input-lens", "512",
                         "--output-lens", "256", "--rates", "50,100", "--num-prompts", "100",
                         "--max-backlog", "8", timeout=30)
    finally:
        sim.stop()
    assert result.returncode == 0, result.stderr
    lines = jsonl(out)
    assert len(lines) == 5 and {line["request_rate"] for line in lines} == {50.0}
    assert "max backlog 8" in lines[0]["overloaded"] and lines[0]["unfinished"] >= 90
    assert "OVERLOADED" in result.stderr and "1 higher-rate cells skipped" in result.stderr


def test_ctrl_c_keeps_finished_cells(log_dir: Path, fast_sim: SimProcess) -> None:
    out = log_dir / "interrupted.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "extproc", "benchmark", "-m", MODEL, "--endpoint",
                             fast_sim.url, "-o", str(out), "--input-lens", "64,128,256", "--output-lens", "8",
                             "--rates", "25", "--num-prompts", "50"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: out.exists() and len(jsonl(out)) >= 5, timeout=30, what="first cell written")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    lines = jsonl(out)
    assert len(lines) in (5, 10) and "interrupted" in stderr  # whole cells only
    assert "Traceback" not in stderr


def test_unreachable_endpoint_is_a_clear_error(log_dir: Path) -> None:
    out = log_dir / "never.jsonl"
    result = extproc("benchmark", "-m", MODEL, "--endpoint", f"http://127.0.0.1:{free_port()}",
                     "-o", str(out),
                     "--api-key", SECRET, "--input-lens", "8", "--output-lens", "8", "--rates", "1")
    assert result.returncode == 1 and "cannot benchmark" in result.stderr
    assert SECRET not in result.stdout + result.stderr and not out.exists()


def test_wrong_model_is_a_clear_error(log_dir: Path, fast_sim: SimProcess) -> None:
    result = extproc("benchmark", "-m", "no-such-model", "--endpoint", fast_sim.url, "-o",
                     str(log_dir / "x.jsonl"), "--input-lens", "8", "--output-lens", "8", "--rates", "1")
    assert result.returncode == 1 and "HTTP 4" in result.stderr


@pytest.mark.parametrize("content, args, message", [
    ("", [], "no benchmark lines"),
    ('{"input_tokens": 8, "output_tokens": 8, "request_rate": 1, "metric": "TPUT", "mean": 1}\n', [],
     "no TT, E2E, TTFT, TPOT lines"),
    (None, ["--bogus", "1"], "unrecognized arguments: --bogus"),
    (None, ["--e2e", "-1"], "SLO e2e must be a positive number"),
])
def test_gen_profile_bad_inputs(log_dir: Path, content: str | None, args: list[str], message: str) -> None:
    path = log_dir / "bad.jsonl"
    if content is None:
        path = AIBRIX_DATA / "simulator-llama2-7b-a40.jsonl"
    else:
        path.write_text(content)
    result = extproc("gen-profile", "d", "--benchmark", str(path), "--cost", "1", *args)
    assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_aibrix_files_parse_and_turn_into_profiles(log_dir: Path) -> None:
    old = load_profile(AIBRIX_DATA / "simulator-llama2-7b-a40.json")  # AIBrix's older shape: no e2e, no slos
    assert old.gpu == "simulator-llama2-7b-a40" and old.e2e is None and len(old.tputs) == len(old.outputs)
    result = extproc("gen-profile", "simulator-llama2-7b-a100", "--benchmark",
                     str(AIBRIX_DATA / "simulator-llama2-7b-a100.jsonl"), "--cost", "1", "--e2e", "2")
    assert result.returncode == 0, result.stderr
    profile = parse_profile(json.loads(result.stdout))
    assert profile.inputs == old.inputs and profile.outputs == old.outputs
    assert profile.e2e is not None and profile.slos == {"percentile": 0, "e2e": 2.0}
    values = [v for row in profile.tputs for v in row]
    assert 0 in values and any(v > 0 for v in values)


def test_admitted_run_records_what_a_routed_replica_serves(benchmarks: dict[str, tuple[Path, str]],
                                                          log_dir: Path, slow_sim: SimProcess) -> None:
    """benchmark --admitted holds the replica at each budget of the ladder (Little's budget x the factors,
    then doubled while a budget meets the SLO and serves more, up to --max-budget) for each cell of a
    profile; gen-profile --admitted records what it served as tputs_admitted (never
    below tputs) and the budget as concurrency_admitted, and refuses the file as the rate run itself."""
    path, _ = benchmarks["slow"]
    base = log_dir / "slow-base.json"
    tpot = ["--tpot", "1.0", "--percentile", "99"]
    assert extproc("gen-profile", "llama2-7b-slow", "--benchmark", str(path), "--cost", "1", *tpot,
                   "-o", str(base)).returncode == 0
    runs = log_dir / "slow-admitted.jsonl"
    result = extproc("benchmark", "-m", MODEL, "--endpoint", slow_sim.url, "-o", str(runs), "--admitted",
                     str(base), "--num-prompts", "12", "--budget-factors", "1", "2", "--max-budget", "4")
    assert result.returncode == 0, result.stderr
    lines = jsonl(runs)
    profile = load_profile(base)
    assert {(x["input_tokens"], x["output_tokens"]) for x in lines} == {(128, 16), (512, 16)}
    ladders = {}
    for x in lines:
        o, i = profile.cell(x["input_tokens"], x["output_tokens"])
        little = max(1, math.floor(profile.tputs[o][i] * profile.e2e[o][i]))
        assert x["concurrency"] in (little, 2 * little, 4 * little) and x["request_rate"] == x["concurrency"]
        assert x["concurrency"] <= max(4, little)
        ladders.setdefault((o, i), set()).add(x["concurrency"])
    assert any(len(ks) >= 2 for ks in ladders.values())  # both budgets run where the first did not overload
    climbed = sum(len(ks) - 2 for ks in ladders.values() if len(ks) > 2)
    assert (f"{climbed} budgets run past the ladder" in result.stderr) == (climbed > 0)
    out = log_dir / "slow-with-admitted.json"
    result = extproc("gen-profile", "llama2-7b-slow", "--benchmark", str(path), "--cost", "1", *tpot,
                     "--admitted", str(runs), "-o", str(out))
    assert result.returncode == 0, result.stderr
    p = load_profile(out)
    assert p.tputs == profile.tputs and p.tputs_admitted is not None
    assert all(a >= t > 0 for ra, rt in zip(p.tputs_admitted, p.tputs) for a, t in zip(ra, rt))
    assert p.concurrency_admitted is not None
    assert all(p.concurrency_admitted[o][i] in ks for (o, i), ks in ladders.items())
    raw = json.loads(out.read_text())
    assert set(raw) >= {"gpu", "cost", "tputs", "indexes", "created", "e2e", "slos", "tputs_admitted",
                        "concurrency_admitted"}
    wrong = extproc("gen-profile", "x", "--benchmark", str(runs), "--cost", "1", *tpot)
    assert wrong.returncode != 0 and "--admitted" in wrong.stderr

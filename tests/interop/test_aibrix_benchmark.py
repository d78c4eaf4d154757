"""AIBrix's own benchmark client, unchanged, through Envoy + the gateway to engine-sim; its output through
`extproc gen-profile` and AIBrix's own gen_profile side by side; our `gen-profile --admitted` files read
by AIBrix's FileProfileReader and planned on by its optimizer (GPUProfile ignores `tputs_admitted` and
`concurrency_admitted`).

Two deployments (a simulated A100 and V100, one pod each) so the optimizer has a choice to make; each
is benchmarked on a small grid, the way AIBrix's benchmark.sh runs gpu_benchmark.py per cell."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from extproc.gpu_profiles import load_profile
from extproc.localstack import LocalStack, http_get
from tests.integration.sim_fixtures import SimProcess, start_sim
from tests.support.stack import running_stack

pytestmark = pytest.mark.integration

GPUS = {"llama2-7b-a100": "A100-80GB", "llama2-7b-v100": "V100"}  # deployment (= served model) -> preset
COSTS = {"llama2-7b-a100": "2", "llama2-7b-v100": "1"}  # relative, per replica
# 50 prompts a cell: the client's arrivals (numpy, seed 0) then span about their expected time, so a cell
# the engine keeps up with passes gen-profile's "throughput >= 0.9 x rate" (at 24 they span 1.2x)
INPUT_LENS, OUTPUT_LENS, RATES, PROMPTS = (64, 512), (16,), (4.0, 16.0), 50
METRICS = {"TPUT", "TT", "E2E", "TTFT", "TPOT"}
CELL_TIMEOUT_S = 120  # AIBrix's client re-sends a request answered with an error forever: bound it


@dataclass
class Deployment:
    name: str
    sim: SimProcess
    benchmark: Path  # AIBrix's JSONL, every cell appended as benchmark.sh does


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aibrix-interop")


@pytest.fixture(scope="module")
def sims(log_dir: Path) -> Iterator[dict[str, SimProcess]]:
    started: dict[str, SimProcess] = {}
    try:
        for name, gpu in GPUS.items():
            started[name] = start_sim(["--gpu", gpu, "--model", "llama2-7b", "--served-model-name", name,
                                       "--time-scale", "10"], log_dir)
        yield started
    finally:
        for sim in started.values():
            sim.stop()


@pytest.fixture(scope="module")
def stack(log_dir: Path, sims: dict[str, SimProcess]) -> Iterator[LocalStack]:
    models = {name: {"pods": [{"name": f"{name}-0", "address": f"127.0.0.1:{sim.port}", "deployment": name,
                               "labels": {"gpu": GPUS[name]}}]} for name, sim in sims.items()}
    with running_stack(log_dir, {"models": models}) as s:
        yield s


def aibrix(python: Path, module: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", f"aibrix.gpu_optimizer.{module}", *args], capture_output=True,
                          text=True, timeout=timeout)


def extproc(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extproc", *args], capture_output=True, text=True,
                          timeout=timeout)


def jsonl(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_grid(python: Path, stack: LocalStack, model: str, out: Path) -> None:
    """benchmark.sh's loop: gpu_benchmark.py once per (input, output, rate), stdout appended."""
    with out.open("w") as f:
        for i in INPUT_LENS:
            for o in OUTPUT_LENS:
                for rate in RATES:
                    result = aibrix(
                        python, "optimizer.profiling.gpu_benchmark", "--backend=vllm", "--host", "127.0.0.1",
                        "--port", str(stack.envoy_port), f"--model={model}", f"--request-rate={rate}",
                        f"--num-prompts={PROMPTS}", "--input-len", str(i), "--output-len", str(o), "--stream",
                        timeout=CELL_TIMEOUT_S)
                    assert result.returncode == 0, result.stderr[-2000:]
                    f.write(result.stdout)


@pytest.fixture(scope="module")
def deployments(aibrix_python: Path, stack: LocalStack, sims: dict[str, SimProcess],
                log_dir: Path) -> dict[str, Deployment]:
    out = {name: Deployment(name, sim, log_dir / f"{name}.jsonl") for name, sim in sims.items()}
    with ThreadPoolExecutor(len(out)) as pool:  # both deployments at once: two pods, two clients
        for f in [pool.submit(run_grid, aibrix_python, stack, d.name, d.benchmark) for d in out.values()]:
            f.result()
    return out


def engine_counter(sim: SimProcess, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = http_get(sim.url + "/metrics")[1].decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def test_the_client_measures_every_cell_through_the_gateway(deployments: dict[str, Deployment],
                                                            stack: LocalStack) -> None:
    """Every cell has AIBrix's five metric lines over all its samples, and every request went through
    Envoy and the gateway to its deployment's pod and finished there."""
    cells = len(INPUT_LENS) * len(OUTPUT_LENS) * len(RATES)
    for d in deployments.values():
        lines = jsonl(d.benchmark)
        assert {(x["input_tokens"], x["output_tokens"], x["request_rate"], x["metric"]) for x in lines} == {
            (i, o, r, m) for i in INPUT_LENS for o in OUTPUT_LENS for r in RATES for m in METRICS}
        assert all(x["samples"] == PROMPTS and x["model"] == d.name for x in lines)
        assert all(x["mean"] > 0 for x in lines if x["metric"] in ("TPUT", "TT", "E2E")), lines
        routed = stack.sample("extproc_requests_total", model=d.name, pod=f"{d.name}-0", code="200")
        assert routed == cells * PROMPTS
        assert engine_counter(d.sim, "vllm:request_success_total") == cells * PROMPTS


def test_the_engine_counts_aibrix_prompts_as_the_tokens_they_are(deployments: dict[str, Deployment]) -> None:
    """AIBrix's synthetic prompt of n tokens is "hi " n times, n tokens to a BPE tokenizer; engine-sim
    counted 4 characters a token (a "512-token" prompt was 384)."""
    for d in deployments.values():
        sent = PROMPTS * len(OUTPUT_LENS) * len(RATES) * sum(INPUT_LENS)
        counted = engine_counter(d.sim, "vllm:prompt_tokens_total")
        assert abs(counted / sent - 1) <= 0.02, (counted, sent)


def flat(matrix: list[list[float]]) -> list[float]:
    return [v for row in matrix for v in row]


def profiles(python: Path, benchmark: Path, name: str, slos: list[str], out_dir: Path) -> tuple[dict, dict]:
    """(ours, AIBrix's) profile of one benchmark file under the same SLOs."""
    ours_path, theirs_path = out_dir / f"{name}-ours.json", out_dir / f"{name}-aibrix.json"
    ours = extproc("gen-profile", name, "--benchmark", str(benchmark), "--cost", "1", *slos,
                   "-o", str(ours_path))
    assert ours.returncode == 0, ours.stderr
    theirs = aibrix(python, "optimizer.profiling.gen_profile", name, "--benchmark", str(benchmark),
                    "--cost", "1", *slos, "-o", str(theirs_path))
    assert theirs.returncode == 0, theirs.stderr
    return json.loads(ours_path.read_text()), json.loads(theirs_path.read_text())


def test_gen_profile_picks_what_aibrix_gen_profile_picks(aibrix_python: Path,
                                                         deployments: dict[str, Deployment],
                                                         log_dir: Path) -> None:
    """Our gen-profile and AIBrix's on the client's output: the same grid and the same throughput per cell,
    with a loose SLO (every cell qualifies) and with a TPOT P99 SLO at the median measured, which some
    cells miss."""
    for d in deployments.values():
        lines = jsonl(d.benchmark)
        tpots = sorted(x["P99"] for x in lines if x["metric"] == "TPOT")
        for slos in (["--e2e", "60"], ["--tpot", f"{tpots[len(tpots) // 2]:.6f}", "--percentile", "99"]):
            ours, theirs = profiles(aibrix_python, d.benchmark, d.name, slos, log_dir)
            assert ours["indexes"] == theirs["indexes"] == [list(OUTPUT_LENS), list(INPUT_LENS)]
            assert flat(ours["tputs"]) == pytest.approx(flat(theirs["tputs"])), slos
            assert flat(ours["e2e"]) == pytest.approx(flat(theirs["e2e"])), slos
            values = flat(ours["tputs"])
            assert all(0 <= v <= 1.5 * max(RATES) for v in values), values
            if slos[0] == "--e2e":  # a simulated engine at 10x keeps up with the top rate in every cell
                assert all(v >= 0.9 * max(RATES) for v in values), values
        load_profile(log_dir / f"{d.name}-ours.json")  # and our own loader reads what we wrote
    # the A100 is the faster engine: lower end-to-end latency in every cell, as the simulator's roofline says
    a100, v100 = (load_profile(log_dir / f"{name}-ours.json") for name in GPUS)
    assert all(a < v for ra, rv in zip(a100.e2e or (), v100.e2e or ()) for a, v in zip(ra, rv)), (a100, v100)


PLAN = """
import json, math, sys
import numpy as np
from aibrix.gpu_optimizer.load_monitor.helpers import Centeroid, DataPoint, DataPoints
from aibrix.gpu_optimizer.load_monitor.profile_reader import FileProfileReader
from aibrix.gpu_optimizer.optimizer import Optimizer

files, output_tokens, input_tokens, rate = json.loads(sys.argv[1])
profiles = FileProfileReader(files).read()
optimizer = Optimizer(1.0, profiles)
# the load monitor's cluster of a minute of requests, in log2 tokens as its load reader gives them
points = DataPoints(np.array([DataPoint(math.log2(output_tokens), math.log2(input_tokens), age=second)
                              for second in range(60)]))
center = Centeroid()
for i in range(len(points)):
    center.add(points.datapoint(i))
ok = optimizer.set_workload_distribution([center], rate)
print(json.dumps({"profiles": [vars(p) for p in profiles], "ok": ok, "plan": optimizer.run()}))
"""


def test_aibrix_optimizer_plans_from_our_admitted_profiles(aibrix_python: Path,
                                                           deployments: dict[str, Deployment],
                                                           log_dir: Path) -> None:
    """gen-profile --admitted files (with `tputs_admitted`) through AIBrix's FileProfileReader into
    GPUProfile and its optimizer: it reads our tputs unchanged and plans a fleet that covers the load."""
    files = []
    for d in deployments.values():
        gen = ["gen-profile", d.name, "--benchmark", str(d.benchmark), "--cost", COSTS[d.name], "--e2e", "60"]
        base = log_dir / f"{d.name}-base.json"
        assert extproc(*gen, "-o", str(base)).returncode == 0
        runs = log_dir / f"{d.name}-admitted.jsonl"
        result = extproc("benchmark", "-m", d.name, "--endpoint", d.sim.url, "-o", str(runs), "--admitted",
                         str(base), "--num-prompts", "12", "--budget-factors", "1", "2")
        assert result.returncode == 0, result.stderr
        path = log_dir / f"{d.name}-with-admitted.json"
        result = extproc(*gen, "--admitted", str(runs), "-o", str(path))
        assert result.returncode == 0, result.stderr
        written = json.loads(path.read_text())
        assert written["tputs_admitted"] and written["concurrency_admitted"]
        files.append(str(path))

    ours = {p["gpu"]: p for p in (json.loads(Path(f).read_text()) for f in files)}
    top = max(max(flat(p["tputs"])) for p in ours.values())
    rate = 3 * top  # more than one replica of the fastest can serve
    result = subprocess.run([str(aibrix_python), "-c", PLAN, json.dumps([files, 16, 512, rate])],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout.splitlines()[-1])
    for read in answer["profiles"]:
        assert read["tputs"] == ours[read["gpu"]]["tputs"] and read["indexes"] == ours[read["gpu"]]["indexes"]
        # GPUProfile keeps its own fields: the extra ones are ignored
        assert "tputs_admitted" not in read and "concurrency_admitted" not in read
    plan = answer["plan"]
    assert answer["ok"] and plan is not None, result.stderr
    counts = {gpu: n for gpu, n in plan.items() if gpu in ours}
    o, i = OUTPUT_LENS.index(16), INPUT_LENS.index(512)
    assert sum(n * ours[gpu]["tputs"][o][i] for gpu, n in counts.items()) >= rate * 0.999, plan
    assert plan["cost"] == pytest.approx(sum(n * ours[gpu]["cost"] for gpu, n in counts.items())), plan

"""SLO profiles for the fleet simulation, measured on the engine model in virtual time.

The same procedure as `extproc benchmark` + `extproc gen-profile` (profiling/), without sockets: for
every (input, output) cell, Poisson arrivals at rates 1, 2, 4, … on one replica of the GPU type; each
run gives AIBrix's metric lines; the cell's throughput at the SLO is chosen by gen-profile's own rule
(profiling.selection.select). Then `tputs_admitted` and `concurrency_admitted` (gpu_profiles): the same
replica held at a per-pod budget of k requests in flight, k = Little's budget max(1, floor(tput x e2e))
doubled while the P99 meets the SLO, as `extproc benchmark --admitted` does with its default factors.
These are benchmarks of one replica, as an operator would run them on a real GPU; the optimizer never
reads the engine model itself. Cached per (GPU, model, SLO, engine settings).
"""

from __future__ import annotations

import math
from dataclasses import replace

from extproc.fleetsim.saturation import build_engine
from extproc.fleetsim.scenario import Scenario
from extproc.gpu_profiles import GpuProfile
from extproc.profiling.gen_profile import build_profile
from extproc.profiling.records import MetricLine
from extproc.profiling.selection import ADMITTED_KEY, Admitted, SLOs, admitted, budget_ladder, select
from extproc.profiling.stats import Summary
from extproc.sim.engine import Engine
from extproc.sim.virtual import LoadResult, run_admitted, run_open_loop
from extproc.slo.state import SloState, learned

INPUTS = (128, 512, 2048, 4096, 7168)  # 7168 + 1024 fits an 8K context
OUTPUTS = (16, 64, 256, 1024)
RATES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
LOW_RATES = (0.5, 0.25, 0.125)
SAMPLES = 400  # a realised Poisson rate within a few % of the nominal one (gen-profile checks TPUT)


def scenario_slos(scenario: Scenario) -> SLOs:
    targets = {k: v for k, v in (("tpot", scenario.slo.tpot_s), ("ttft", scenario.slo.ttft_s)) if v}
    return SLOs(percentile=99, targets=targets)


def _lines(i: int, o: int, rate: float, res: LoadResult) -> list[MetricLine]:
    done = res.finished
    span = max(res.duration, 1e-9)

    def line(metric: str, values: list[float] | None = None, mean: float | None = None) -> MetricLine:
        stats = {"mean": mean} if values is None else Summary.of(values or [0.0]).as_fields()
        return MetricLine(i, o, rate, metric, stats)

    tpots = [(s.finish_time - s.first_token_time) / (s.num_output - 1)  # type: ignore[operator]
             for s in done if s.num_output > 1]
    return [line("TPUT", mean=len(done) / span), line("TT", mean=sum(s.num_output for s in done) / span),
            line("E2E", [s.finish_time - s.arrival for s in done]),  # type: ignore[operator]
            line("TTFT", [s.first_token_time - s.arrival for s in done]),  # type: ignore[operator]
            line("TPOT", tpots)]


def virtual_profile(scenario: Scenario, gpu: str, deployment: str) -> GpuProfile:
    """The GPU type's profile (AIBrix's format) for the scenario's model and SLO, named `deployment`."""
    slos = scenario_slos(scenario)
    key = (gpu, scenario.model, tuple(sorted(scenario.engine.items())), tuple(sorted(slos.targets.items())))
    if key not in _CACHE:
        _CACHE[key] = _profile(scenario, gpu, slos)
    return replace(_CACHE[key], gpu=deployment)


_CACHE: dict[tuple[object, ...], GpuProfile] = {}


def _profile(scenario: Scenario, gpu: str, slos: SLOs) -> GpuProfile:
    lines: list[MetricLine] = []
    for i in INPUTS:
        for o in OUTPUTS:
            engine = build_engine(scenario, gpu)
            if i + o > engine.max_model_len:
                continue
            # Up from 1 req/s while the SLO holds; where even 1 req/s misses it (long prompts whose
            # prefill stalls the other requests' decodes), down to LOW_RATES, so a shape one replica can
            # serve only slowly gets its real rate instead of 0 ("this GPU type cannot serve it").
            for rate in RATES:
                if not _measure(scenario, gpu, slos, i, o, rate, lines):
                    if rate == RATES[0]:
                        any(_measure(scenario, gpu, slos, i, o, low, lines) for low in LOW_RATES)
                    break  # higher rates only get worse
    profile = build_profile(gpu, select(lines, slos, f"virtual {gpu}"), 1.0, slos, 0.0)
    got = admitted_runs(scenario, gpu, profile, slos)
    return replace(profile, tputs_admitted=got.tputs, concurrency_admitted=got.budgets)


ADMITTED_MIN_REQUESTS = 40


def admitted_runs(scenario: Scenario, gpu: str, profile: GpuProfile, slos: SLOs) -> Admitted:
    """Per cell, one replica held at each budget of the ladder up to the first that misses the SLO
    (profiling.selection.admitted keeps the one that served most)."""
    lines: list[MetricLine] = []
    max_len = build_engine(scenario, gpu).max_model_len
    for o, out in enumerate(profile.outputs):
        for i, inp in enumerate(profile.inputs):
            e2e = profile.e2e[o][i] if profile.e2e is not None else math.nan
            if inp + out > max_len or not e2e > 0:
                continue
            ladder = budget_ladder(profile.tputs[o][i], e2e, DOUBLINGS)
            for limit in ladder:
                cell = _admitted_lines(build_engine(scenario, gpu), inp, out, limit, e2e / limit)
                lines.extend(cell)
                if not cell or not _meets(slos, cell):
                    break  # larger budgets only get worse
    return admitted(lines, slos, profile.outputs, profile.inputs, profile.tputs, profile.e2e)


DOUBLINGS = tuple(2.0 ** j for j in range(9))  # Little's budget x 1 … 256: stops at the first miss


def _admitted_lines(engine: Engine, inp: int, out: int, limit: int, stagger: float) -> list[MetricLine]:
    res = run_admitted(engine, limit, inp, out, max(ADMITTED_MIN_REQUESTS, 8 * limit), stagger=stagger)
    if res.failed or not res.finished:
        return []
    return [MetricLine(inp, out, float(limit), line.metric,
                       line.stats if line.metric != "TPUT" else {"mean": _steady_rate(res, limit)},
                       {ADMITTED_KEY: limit})
            for line in _lines(inp, out, float(limit), res)]


def _steady_rate(res: LoadResult, limit: int) -> float:
    """Completions/s once the first `limit` (the ramp) are done."""
    ends = sorted(s.finish_time for s in res.finished)  # type: ignore[type-var]
    if len(ends) <= limit + 1:
        return len(ends) / res.duration if res.duration > 0 else 0.0
    return (len(ends) - limit - 1) / (ends[-1] - ends[limit])


def _measure(scenario: Scenario, gpu: str, slos: SLOs, i: int, o: int, rate: float,
             lines: list[MetricLine]) -> bool:
    """One (input, output, rate) run appended to `lines`; whether it met the SLO."""
    cell = _lines(i, o, rate, run_open_loop(build_engine(scenario, gpu), rate, i, o, SAMPLES))
    lines.extend(cell)
    return _meets(slos, cell)


def _meets(slos: SLOs, cell: list[MetricLine]) -> bool:
    """Whether one run's lines meet the scenario's TPOT and TTFT SLOs."""
    by = {line.metric: line for line in cell}
    return all(slos.passes(m, by.get(m)) for m in ("TPOT", "TTFT") if slos.is_set(m))


def load_slo_profiles(scenario: Scenario, gateway, replicas) -> SloState:  # noqa: ANN001
    """Give a simulated gateway's SLO state one profile per deployment (GPU type) of the fleet."""
    state: SloState = learned(gateway.router.state.store)  # type: ignore[assignment]  (built at config load)
    gpus = {r.deployment: r.gpu for r in replicas}
    state.set_profiles(scenario.model, {d: virtual_profile(scenario, gpu, d) for d, gpu in gpus.items()})
    return state

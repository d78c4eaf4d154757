"""What a benchmark runs, whatever it runs against: the grid of cells, the budget ladder of an admitted run,
and the limits that cut a cell off. Pure.

`extproc benchmark` runs a plan against an OpenAI endpoint over HTTP; the fleet simulation runs the same
plan against the engine model in virtual time (profiling/virtual.py). Both go through profiling/sweep.py,
so a profile made in the simulation is the one a user with that GPU would make.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from extproc.gpu_profiles import GpuProfile
from extproc.profiling.selection import BUDGET_FACTORS, budget_ladder
from extproc.profiling.workload import Cell, doubling

# The default grid covers what users send, long prompts included: powers of two to 8K, plus 6K, where a long
# prompt still leaves an 8K-context model room for its answer (8192 + any output does not fit one). Without
# it, 5-7K-token prompts would take the 8K cell's answer (nothing served) or the 4K cell's (too rosy).
DEFAULT_INPUT_LENS = tuple(sorted({*doubling(4, 8192), 6144}))
DEFAULT_OUTPUT_LENS = tuple(doubling(4, 4096))
DEFAULT_RATES = tuple(float(r) for r in doubling(1, 64))
DEFAULT_NUM_PROMPTS = 100
# How far a cell's ladder may climb without --max-budget (LoadPlan.climb_cap): vLLM's default
# max_num_seqs, the most requests a replica runs at once.
UNMEASURED_CAP = 256


@dataclass(frozen=True, slots=True)
class LoadPlan:
    input_lens: tuple[int, ...] = DEFAULT_INPUT_LENS
    output_lens: tuple[int, ...] = DEFAULT_OUTPUT_LENS
    rates: tuple[float, ...] = DEFAULT_RATES
    num_prompts: int = DEFAULT_NUM_PROMPTS
    seed: int = 0
    max_backlog: int = 1000  # cut a cell off with this many requests in flight (0: never)
    drain_timeout: float = 600.0  # ... or with requests still running this long after its last arrival
    # (an admitted cell: with one request running this long)
    admitted: GpuProfile | None = None  # run each of its cells at the router's budget instead
    budget_factors: tuple[float, ...] = BUDGET_FACTORS  # admitted: the budgets tried, x Little's budget
    max_budget: int | None = None  # admitted: climb past the factors up to this (None: see climb_cap)

    def cells(self) -> list[Cell]:
        """AIBrix's order: input lengths, then output lengths, then rates, each ascending. Admitted: the
        profile's cells, `rate` the requests in flight, the budget ladder ascending."""
        p = self.admitted
        if p is not None:
            return [Cell(i, o, float(k)) for ii, i in enumerate(p.inputs) for oi, o in enumerate(p.outputs)
                    for k in self._ladder_at(oi, ii)]
        return [Cell(i, o, r) for i in sorted(set(self.input_lens)) for o in sorted(set(self.output_lens))
                for r in sorted(set(self.rates))]

    def _ladder_at(self, o: int, i: int) -> list[int]:
        """The admitted profile's cell (output index o, input index i): its own ladder of budgets."""
        p = self.admitted
        assert p is not None
        ladder = budget_ladder(p.tputs[o][i], p.e2e[o][i] if p.e2e else 0.0, self.budget_factors)
        if self.max_budget is None:
            return ladder
        return [k for k in ladder if k <= self.max_budget] or [min(ladder[0], self.max_budget)]

    def climb_cap(self, cell: Cell) -> int | None:
        """Admitted: the largest budget the cell's ladder may climb to past its factors; None: no climb.
        `max_budget` where given, else UNMEASURED_CAP: a cell whose rate run met the SLO at no rate has a
        placeholder Little's budget (1), not a measurement, so the factors multiplied nothing and its top
        rung (8) is where the ladder stopped, not where the replica did; a measured cell climbs too, but
        only from a rung far inside the SLO (`climb_needs_room`)."""
        if self.admitted is None:
            return None
        return self.max_budget if self.max_budget is not None else UNMEASURED_CAP

    def climb_needs_room(self, cell: Cell) -> bool:
        """Without `max_budget`, a measured cell climbs only from a rung whose latencies are at most
        selection.CLIMB_ROOM of their targets: its Little's budget is a measurement, but of a rate run the
        rate grid and the "kept up" rule cap, so x8 of it can stop far short of a fast replica; a rung
        near its target is where the replica is too (docs/profiling.md, "Admitted throughput")."""
        p = self.admitted
        if p is None or self.max_budget is not None:
            return False
        o, i = p.cell(cell.input_tokens, cell.output_tokens)
        return p.tputs[o][i] > 0

    def prompts(self, cell: Cell) -> int:
        """Requests a cell sends: `num_prompts`; a budget the ladder climbed to, and every budget of a cell
        whose whole ladder searches (`max_budget`, or no rate met the SLO), at least 3 per client (with
        fewer a large budget's run is mostly the ramp up to it, and the rate it reads the ramp's)."""
        if self.climb_cap(cell) is None or (self.climb_needs_room(cell) and cell.rate <= self._top(cell)):
            return self.num_prompts  # a measured cell's own ladder: as many as without the climb
        return max(self.num_prompts, 3 * int(cell.rate))

    def _top(self, cell: Cell) -> int:
        """The top rung of the admitted cell's own ladder (its factors)."""
        assert self.admitted is not None
        return max(self._ladder_at(*self.admitted.cell(cell.input_tokens, cell.output_tokens)))

    def fit(self, max_model_len: int) -> LoadPlan:
        """The grid with every input length too long to leave room for the longest output replaced by the
        longest that does: on an 8K-context model an 8,192-token cell fails every request, records 0
        ("cannot serve"), and every prompt nearest to it (7.1K and up) is left out of the plan."""
        cap = max_model_len - max(self.output_lens, default=0)
        if cap < 1 or all(i <= cap for i in self.input_lens):
            return self
        return replace(self, input_lens=tuple(sorted({min(i, cap) for i in self.input_lens})))

    def stagger(self, cell: Cell) -> float:
        """Admitted: seconds between the first requests, the profile's e2e over the budget."""
        p = self.admitted
        if p is None or p.e2e is None:
            return 0.0
        o, i = p.cell(cell.input_tokens, cell.output_tokens)
        return p.e2e[o][i] / cell.rate

    def scheduled_seconds(self, cell: Cell) -> float:
        """How long the cell's arrivals take on average (its share of a progress bar)."""
        return self.prompts(cell) / cell.rate

    def flags(self) -> list[str]:
        """The `extproc benchmark` options that run this plan (the admitted profile aside)."""
        def csv(values: tuple[float, ...]) -> str:
            return ",".join(f"{v:g}" for v in values)

        out = ["--input-lens", csv(self.input_lens), "--output-lens", csv(self.output_lens),
               "--rates", csv(self.rates), "--num-prompts", str(self.num_prompts), "--seed", str(self.seed),
               "--max-backlog", str(self.max_backlog), "--drain-timeout", f"{self.drain_timeout:g}"]
        if self.admitted is not None:
            out += ["--budget-factors", csv(self.budget_factors)]
            if self.max_budget is not None:
                out += ["--max-budget", str(self.max_budget)]
        return out

"""GPU profiles: AIBrix's per-GPU profile JSON (what one deployment, a GPU type, sustains per (input,
output) cell) and the store that keeps the newest one per deployment, from files and from Redis. The
SLO strategies (through the gateway) and the GPU optimizer both read them from here.

The format is AIBrix's (`aibrix_gen_profile`, python/aibrix/aibrix/gpu_optimizer/optimizer/types.py), so
profiles move freely between AIBrix and us:

    {"gpu": "<deployment>", "cost": 1.0,
     "tputs": [[rps, ...], ...],            # [output index][input index], requests/s that meet the SLO
     "indexes": [[outputs...], [inputs...]],
     "created": <unix seconds>,
     "e2e": [[s, ...], ...], "ttft": [[s, ...], ...],   # newer files only
     "tpot": [[s, ...], ...],                           # ours (optional): mean TPOT, see below
     "slos": {"percentile": 99, "e2e": 2.0},            # newer files only
     "tputs_admitted": [[rps, ...], ...],               # ours (optional): see below
     "concurrency_admitted": [[k, ...], ...],          # ours (optional): the budget it was measured at
     "tputs_admitted_max": [[rps, ...], ...]}          # ours (optional): at the largest budget that passed

A throughput of 0 means the deployment cannot meet the SLO in that cell at any rate.

`tputs` follows gen-profile's rule: one replica alone under Poisson arrivals, the highest rate whose P99
meets the SLO. That undercounts what a replica serves behind a router that admits requests to it (a
4.6K-token prompt rarely overlapping well reads 0.12 req/s where one-at-a-time admission serves 0.4), so
our profiles may also carry `tputs_admitted`: requests/s one replica sustains within the SLO when the
gateway holds it at a per-pod budget of k requests in flight, and `concurrency_admitted`: that k per
cell (at least one request at a time; profiling.selection.admitted says which k is kept). The SLO
router admits k of a shape to a pod (`budget`) and the GPU optimizer plans `tputs_admitted` per replica
(`served`), so router and plan count the same replica. `tputs_admitted_max`: the requests/s of the run
at the largest budget that still met the SLO (k is kept at most half of it); the SLO router admits up
to that while a pod's measured speed shows room, and the optimizer's feedback may raise a cell's plan
up to it, never beyond. `tpot`: the mean time per output token at the kept budget (else at the rate
`e2e` was read at); under a TPOT SLO the router expects a request's TPOT from it (AIBrix's e2e holds
the prefill too). AIBrix's reader ignores keys it does not know, so the file still loads there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc import redis_connect

log = logging.getLogger(__name__)

Matrix = tuple[tuple[float, ...], ...]


def profile_key_prefix(model: str) -> str:
    """Redis keys of a model's profiles: `aibrix:profile_<model>_<deployment>` (AIBrix's; gen-profile
    writes them, the SLO router and the GPU optimizer read them)."""
    return f"aibrix:profile_{model}_"


def profile_key(model: str, deployment: str) -> str:
    return profile_key_prefix(model) + deployment


def profile_index_key(model: str) -> str:
    """Ours: the set of a model's profile keys (gen-profile adds each key it writes), so readers find
    them without scanning the keyspace."""
    return f"extproc:profiles:{model}"


# What the SLO router and gen-profile agree on: a profile's admitted budget (`concurrency_admitted`) is
# at most 1/BUDGET_MARGIN of the largest budget its benchmark saw meet the SLO (one shape alone, held at
# its budget, is not what a routed replica sees: a mix, where one long prompt's prefill stalls every other
# decode, and Poisson arrivals keeping it full; measured in the fleet simulation, docs/optimizer.md), and
# the router admits past it up to BUDGET_MARGIN times it while a pod's measured speed shows room. The
# default; `gen-profile --budget-margin` sets another, which the profile carries (`budget_margin`).
BUDGET_MARGIN = 2.0


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the offending key."""


@dataclass(frozen=True, slots=True)
class GpuProfile:
    gpu: str  # the deployment name (AIBrix's key "gpu")
    cost: float  # per replica-hour, relative units
    outputs: tuple[int, ...]  # indexes[0]: output lengths
    inputs: tuple[int, ...]  # indexes[1]: input lengths
    tputs: Matrix  # [output index][input index]: requests/s at the SLO; 0 = cannot meet it
    e2e: Matrix | None  # same shape, seconds; None when absent (older AIBrix files)
    ttft: Matrix | None
    slos: dict[str, float]  # e.g. {"percentile": 99, "e2e": 2.0}; {} when absent
    created: float
    tputs_admitted: Matrix | None = None  # requests/s at the SLO behind the router's admission (ours)
    concurrency_admitted: Matrix | None = None  # the per-pod budget (requests in flight) it was measured at
    tputs_admitted_max: Matrix | None = None  # requests/s at the largest budget that met the SLO (ours)
    tpot: Matrix | None = None  # (ours) mean s/token at the kept budget, else where e2e was read; 0: unknown
    # (ours) the kept budget is at most 1/budget_margin of the largest that met the SLO; the SLO router
    # admits past it up to budget_margin times it while a pod's measured speed shows room
    budget_margin: float = BUDGET_MARGIN

    @property
    def served(self) -> Matrix:
        """What a routed replica sustains per cell: `tputs_admitted` where measured, else `tputs`."""
        return self.tputs_admitted if self.tputs_admitted is not None else self.tputs

    def budget(self, o: int, i: int) -> int:
        """Requests of cell (o, i) one pod holds at once: `concurrency_admitted` where measured, else
        Little's law on the benchmark, max(1, floor(tput x e2e)); 1 (a whole pod) where neither knows."""
        if self.concurrency_admitted is not None and self.concurrency_admitted[o][i] >= 1:
            return int(self.concurrency_admitted[o][i])
        e2e = self.e2e[o][i] if self.e2e is not None else math.nan
        return little_budget(self.tputs[o][i], e2e)

    def cell(self, input_tokens: float, output_tokens: float) -> tuple[int, int]:
        """(out_idx, in_idx) of the cell nearest in log2 space, clamped to the grid's edges.

        Profiles are measured on power-of-two grids, so "nearest" means nearest ratio, not nearest
        difference: 6 tokens is closer to 8 than to 4."""
        return nearest_index(self.outputs, output_tokens), nearest_index(self.inputs, input_tokens)

    def tput(self, input_tokens: float, output_tokens: float) -> float:
        o, i = self.cell(input_tokens, output_tokens)
        return self.served[o][i]


def little_budget(tput: float, e2e: float) -> int:
    """max(1, floor(tput x e2e)): by Little's law the requests a replica holds at the benchmark's rate
    at the SLO; one at a time where the rate or the latency is unknown or 0."""
    return max(1, math.floor(tput * e2e)) if tput > 0 and e2e > 0 else 1


HALFWAY = 1e-9  # log2 distances this close are a tie (trace buckets sit exactly halfway, up to float error)


def nearest_index(ticks: Sequence[int], tokens: float) -> int:
    """Index of the tick nearest to `tokens` in log2 space; tokens < 1 count as 1.

    Exactly halfway between two ticks maps to the larger one (as AIBrix does): the bigger shape costs a
    replica more, so a tie never plans a replica short. Trace buckets 25, 35, ... (precision 10) are
    such ties on a power-of-two grid."""
    x = math.log2(max(float(tokens), 1.0))
    best, best_d = 0, math.inf
    for k, t in enumerate(ticks):  # ticks ascend: on a tie the later, larger one wins
        d = abs(math.log2(t) - x)
        if d <= best_d + HALFWAY:
            best, best_d = k, min(d, best_d)
    return best


def _number(value: Any, key: str, unknown: float | None = None) -> float:
    """A finite non-negative number. NaN (what AIBrix's gen_profile writes for a null statistic) reads
    as `unknown` where the caller gives one, as AIBrix's reader takes it: not a value to plan with."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{key}: expected a number, got {value!r}")
    v = float(value)
    if math.isnan(v) and unknown is not None:
        return unknown
    if not math.isfinite(v) or v < 0:
        raise ProfileError(f"{key}: expected a finite non-negative number, got {value!r}")
    return v


def _ticks(value: Any, key: str) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        raise ProfileError(f"{key}: expected a non-empty list of token counts")
    out: list[int] = []
    for k, v in enumerate(value):
        n = _number(v, f"{key}[{k}]")
        if n < 1 or n != int(n):
            raise ProfileError(f"{key}[{k}]: expected a positive whole token count, got {v!r}")
        out.append(int(n))
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ProfileError(f"{key}: token counts must be strictly increasing, got {out}")
    return tuple(out)


def _matrix(value: Any, key: str, rows: int, cols: int, unknown: float | None = None) -> Matrix:
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or len(value) != rows:
        got = len(value) if isinstance(value, Sequence) else type(value).__name__
        raise ProfileError(f"{key}: expected {rows} rows (one per output length), got {got}")
    out = []
    for r, row in enumerate(value):
        if not isinstance(row, Sequence) or isinstance(row, (str, bytes)) or len(row) != cols:
            got = len(row) if isinstance(row, Sequence) else type(row).__name__
            raise ProfileError(f"{key}[{r}]: expected {cols} columns (one per input length), got {got}")
        out.append(tuple(_number(v, f"{key}[{r}][{c}]", unknown) for c, v in enumerate(row)))
    return tuple(out)


def parse_profile(data: Mapping[str, Any]) -> GpuProfile:
    """Validate AIBrix profile JSON (already decoded) into a GpuProfile."""
    if not isinstance(data, Mapping):
        raise ProfileError(f"profile: expected a JSON object, got {type(data).__name__}")
    for key in ("gpu", "cost", "tputs", "indexes"):
        if key not in data:
            raise ProfileError(f"{key}: missing")
    gpu = data["gpu"]
    if not isinstance(gpu, str) or not gpu:
        raise ProfileError(f"gpu: expected the deployment name, got {gpu!r}")
    indexes = data["indexes"]
    if not isinstance(indexes, Sequence) or isinstance(indexes, (str, bytes)) or len(indexes) != 2:
        raise ProfileError("indexes: expected [[output lengths...], [input lengths...]]")
    outputs = _ticks(indexes[0], "indexes[0]")
    inputs = _ticks(indexes[1], "indexes[1]")
    shape = (len(outputs), len(inputs))
    # NaN: a rate nobody measured serves nothing (0); a latency nobody measured is unknown (NaN, which
    # the SLO router treats as "cannot judge this cell")
    optional = {k: _matrix(data[k], k, *shape, unknown=math.nan if k in ("e2e", "ttft", "tpot") else 0.0)
                if data.get(k) is not None else None
                for k in ("e2e", "ttft", "tpot", "tputs_admitted", "concurrency_admitted",
                          "tputs_admitted_max")}
    slos_raw = data.get("slos") or {}
    if not isinstance(slos_raw, Mapping):
        raise ProfileError(f"slos: expected an object, got {slos_raw!r}")
    slos = {str(k): _number(v, f"slos.{k}") for k, v in slos_raw.items()}
    margin = _number(data.get("budget_margin", BUDGET_MARGIN), "budget_margin")
    if margin < 1:
        raise ProfileError(f"budget_margin: expected a number >= 1, got {data['budget_margin']!r}")
    return GpuProfile(gpu=gpu, cost=_number(data["cost"], "cost"), outputs=outputs, inputs=inputs,
                   tputs=_matrix(data["tputs"], "tputs", *shape, unknown=0.0), e2e=optional["e2e"],
                   ttft=optional["ttft"],
                   slos=slos, created=_number(data.get("created", 0.0), "created"),
                   tputs_admitted=optional["tputs_admitted"],
                   concurrency_admitted=optional["concurrency_admitted"],
                   tputs_admitted_max=optional["tputs_admitted_max"], budget_margin=margin,
                   tpot=optional["tpot"])


def load_profile(path: str | Path) -> GpuProfile:
    """Read one profile file; errors name the file and the key."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ProfileError(f"{path}: {e}") from e
    try:
        return parse_profile(data)
    except ProfileError as e:
        raise ProfileError(f"{path}: {e}") from e


def dump_profile(p: GpuProfile) -> dict[str, Any]:
    """AIBrix's JSON, in the key order aibrix_gen_profile writes; e2e/ttft/slos only when present."""
    out: dict[str, Any] = {"gpu": p.gpu, "cost": p.cost, "tputs": [list(r) for r in p.tputs],
                           "indexes": [list(p.outputs), list(p.inputs)], "created": p.created}
    if p.e2e is not None:
        out["e2e"] = [list(r) for r in p.e2e]
    if p.ttft is not None:
        out["ttft"] = [list(r) for r in p.ttft]
    if p.slos:
        out["slos"] = dict(p.slos)
    if p.tputs_admitted is not None:
        out["tputs_admitted"] = [list(r) for r in p.tputs_admitted]
    if p.concurrency_admitted is not None:
        out["concurrency_admitted"] = [list(r) for r in p.concurrency_admitted]
    if p.budget_margin != BUDGET_MARGIN:  # absent: the default, as every profile made before the key
        out["budget_margin"] = p.budget_margin
    if p.tputs_admitted_max is not None:
        out["tputs_admitted_max"] = [list(r) for r in p.tputs_admitted_max]
    if p.tpot is not None:
        out["tpot"] = [list(r) for r in p.tpot]
    return out

# -- the store ------------------------------------------------------------------------------------
# The newest profile per deployment, from files and from Redis (`aibrix:profile_<model>_<deployment>`).
# A profile names its deployment in "gpu" (AIBrix). The same deployment may have a file profile and a
# Redis profile; the one with the newer `created` wins, so re-running gen-profile takes effect without a
# restart.


def deployment_key(namespace: str, name: str) -> str:
    """A deployment's key in a plan and in the store: `namespace/name`."""
    return f"{namespace}/{name}"


class ProfileStore:
    def __init__(self) -> None:
        self._files: dict[str, GpuProfile] = {}  # gpu -> profile, whatever the model
        self._redis: dict[str, dict[str, GpuProfile]] = {}  # model -> gpu -> profile
        self._refused: set[tuple[str, str]] = set()  # (source, message) already logged

    def _refuse(self, source: str, error: Exception) -> None:
        if (source, str(error)) not in self._refused:
            self._refused.add((source, str(error)))
            log.warning("profile refused: %s: %s", source, error)

    def load_files(self, paths: Iterable[str | Path]) -> list[str]:
        """Read profile files; returns the errors (also logged) so a CLI can fail on them."""
        errors = []
        for path in paths:
            try:
                p = load_profile(path)
            except ProfileError as e:
                errors.append(str(e))
                self._refuse(str(path), e)
                continue
            self._offer(self._files, p)
        return errors

    @staticmethod
    def _offer(table: dict[str, GpuProfile], p: GpuProfile) -> None:
        old = table.get(p.gpu)
        if old is None or p.created >= old.created:
            table[p.gpu] = p

    def offer_redis(self, model: str, key: str, raw: Any) -> None:
        try:
            data = json.loads(raw)
            p = parse_profile(data)
        except (ValueError, TypeError) as e:  # ProfileError and JSONDecodeError are ValueErrors
            self._refuse(key, e)
            return
        self._offer(self._redis.setdefault(model, {}), p)

    def profile_for(self, model: str, namespace: str, name: str) -> GpuProfile | None:
        """The newest profile for the deployment, renamed to its `namespace/name` key for the plan."""
        key = deployment_key(namespace, name)
        candidates = [t.get(n) for t in (self._files, self._redis.get(model, {})) for n in (key, name)]
        found = [p for p in candidates if p is not None]
        if not found:
            return None
        best = max(found, key=lambda p: p.created)
        return dataclasses.replace(best, gpu=key)

    async def refresh_redis(self, redis: Any, deployments: Mapping[str, Iterable[str]]) -> int:
        """Read each model's profiles by key, without scanning the keyspace: AIBrix's
        `aibrix:profile_<model>_<deployment>` of the deployments serving it (as AIBrix writes them),
        and every key in the model's index (as gen-profile writes them); take what is newer. Returns
        how many keys were read."""
        n = 0
        for model, names in deployments.items():
            indexed = await redis.smembers(profile_index_key(model))
            keys = sorted({profile_key(model, name) for name in names if name}
                          | {k.decode() if isinstance(k, bytes) else k for k in indexed})
            if not keys:
                continue
            # Key by key in one pipeline, not MGET: on a Redis Cluster they lie on several shards.
            pipe = redis_connect.pipeline(redis)
            for key in keys:
                pipe.get(key)
            for key, raw in zip(keys, await pipe.execute()):
                if raw is not None:
                    self.offer_redis(model, key, raw)
                    n += 1
        return n

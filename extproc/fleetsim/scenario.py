"""A fleet-simulation scenario: the fleet, the traffic, the timeline of events, the SLO.

Loaded from YAML (format: scenarios/README.md). Pure data plus validation; nothing here runs anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from extproc.config.source import line_of, read_yaml
from extproc.fleetsim.lengths import Lengths, parse_lengths
from extproc.gpu_profiles import BUDGET_MARGIN
from extproc.optimizer.config_errors import ConfigError
from extproc.optimizer.policy import KEYS as POLICY_KEYS
from extproc.optimizer.policy import PROVISION_S, STABILIZATION_S, PlanPolicy, parse_policy
from extproc.sim.gpus import get_gpu
from extproc.sim.models import get_model

DEFAULT_STRATEGIES = ("round-robin", "least-request", "load-balance")


@dataclass(frozen=True, slots=True)
class Group:
    """Replicas of one GPU type (one Deployment in Kubernetes terms)."""

    gpu: str
    replicas: int
    name: str  # deployment name; the report groups by GPU type
    tensor_parallel: int | None = None
    # With the optimizer in the loop (`autoscale`): `replicas` is the most it may run, `initial` how
    # many run at the start, `min_replicas` the label model.aibrix.ai/min_replicas, `cost` per hour.
    initial: int | None = None
    min_replicas: int = 0
    cost: float = 1.0


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Requests of a stream share long prefixes: each belongs to one of `groups` (a system prompt, a
    few-shot template, a conversation's history), drawn with Zipf popularity `skew` (0: uniform); the
    group's prefix length is drawn once from `tokens`; the stream's `prompt` lengths are what follows."""

    groups: int
    tokens: Lengths
    skew: float = 1.0


@dataclass(frozen=True, slots=True)
class Stream:
    """One Poisson arrival stream with its own length distributions."""

    name: str
    rate: float  # requests per second before --rate-scale and rate events
    prompt: Lengths
    output: Lengths
    # What the client sends as max_tokens (routing may read it). None: clients send none, as most chat
    # clients; the engine still stops at the sampled output length, which routing never sees.
    max_tokens: int | None = None
    prefix: SharedPrefix | None = None


@dataclass(frozen=True, slots=True)
class RateChange:
    """Multiply every stream's rate (or only `stream`'s) by `factor` during [start, end); 0 stops it."""

    start: float
    end: float
    factor: float
    stream: str | None = None


@dataclass(frozen=True, slots=True)
class Autoscale:
    """The GPU optimizer in the loop: it re-plans every `interval_s` from the traces of the last
    `window_s` (its live schedule), and a replica it adds serves `provision_s` later. The PodAutoscaler
    scales down only to the highest count asked for in the last `stabilization_s` (Kubernetes HPA's
    behavior.scaleDown.stabilizationWindowSeconds, default 300)."""

    provision_s: float = PROVISION_S
    interval_s: float = 10.0
    window_s: float = 240.0
    stabilization_s: float = STABILIZATION_S
    # the optimizer's constants, the same keys as its config's `planning:` section (optimizer/policy.py);
    # its provision_s is this section's
    policy: PlanPolicy = PlanPolicy()

    def resolved(self) -> PlanPolicy:
        return replace(self.policy, provision_s=self.provision_s).resolved(self.interval_s, self.window_s)


@dataclass(frozen=True, slots=True)
class ReplicaLoss:
    """At `at`, the last `fraction` of a GPU type's replicas disappear (their open requests fail)."""

    at: float
    gpu: str
    fraction: float


SLO_KEYS = ("tpot_s", "ttft_s", "e2e_s", "tpat_s")  # gen-profile's --tpot, --ttft, --e2e, --tpat


@dataclass(frozen=True, slots=True)
class Slo:
    """Each target a P99 bound in seconds (None: not set); a request meets the SLO when it keeps all."""

    tpot_s: float | None = None  # per-request mean time per output token
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpat_s: float | None = None  # E2E over prompt + output tokens (AIBrix's time per all tokens)

    @property
    def targets(self) -> dict[str, float]:
        """The targets set, by gen-profile's metric names ("tpot", "ttft", "e2e", "tpat")."""
        return {key[:-2]: v for key in SLO_KEYS if (v := getattr(self, key)) is not None}

    def met(self, ttft: float, tpot: float | None, e2e: float = math.nan, tpat: float = math.nan) -> bool:
        if self.ttft_s is not None and ttft > self.ttft_s:
            return False
        if self.e2e_s is not None and e2e > self.e2e_s:
            return False
        if self.tpat_s is not None and tpat > self.tpat_s:
            return False
        return not (self.tpot_s is not None and tpot is not None and tpot > self.tpot_s)


@dataclass(frozen=True, slots=True)
class GatewayTiming:
    """The live gateway's background schedules (DESIGN.md "Background loops")."""

    metrics_refresh_s: float = 1.0   # engine metric scrape: the sample routing sees is the last one
    capacity_refresh_s: float = 1.0  # Accounting.refresh: token deltas into the capacity estimator
    sync_interval_s: float = 0.1     # shared state (Redis) sync between gateway replicas


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    model: str
    groups: tuple[Group, ...]
    streams: tuple[Stream, ...]
    duration_s: float = 600.0
    warmup_s: float = 60.0  # excluded from the report: capacities start unknown, as after a deploy
    slo: Slo = Slo()
    rate_changes: tuple[RateChange, ...] = ()
    losses: tuple[ReplicaLoss, ...] = ()
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    timing: GatewayTiming = GatewayTiming()
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig overrides for every replica
    description: str = ""
    autoscale: Autoscale | None = None  # the optimizer's defaults for --optimizer
    # the virtual profiles' `benchmark --admitted --max-budget` (None: the ladder's factors only)
    profile_max_budget: int | None = None
    profile_budget_margin: float = BUDGET_MARGIN  # ... and their `gen-profile --budget-margin`

    @property
    def total_rate(self) -> float:
        return sum(s.rate for s in self.streams)

    def rate_factor(self, t: float, stream: str | None = None) -> float:
        f = 1.0
        for c in self.rate_changes:
            if c.start <= t < c.end and (c.stream is None or c.stream == stream):
                f *= c.factor
        return f

    def scaled(self, rate_scale: float = 1.0, duration_s: float | None = None) -> Scenario:
        streams = tuple(replace(s, rate=s.rate * rate_scale) for s in self.streams)
        out = replace(self, streams=streams)
        if duration_s is not None:
            out = replace(out, duration_s=duration_s, warmup_s=min(self.warmup_s, duration_s / 4))
        return out


BUILTIN = resources.files("extproc.fleetsim") / "scenarios"


def builtin_names() -> list[str]:
    return sorted(p.name[:-5] for p in BUILTIN.iterdir() if p.name.endswith(".yaml"))


def load(name_or_path: str) -> Scenario:
    """A built-in scenario by name, or a YAML file."""
    path = Path(name_or_path)
    if name_or_path.endswith((".yaml", ".yml")) or path.exists():
        text = path.read_text()
    else:
        candidate = BUILTIN / f"{name_or_path}.yaml"
        if not candidate.is_file():
            raise ValueError(f"no scenario {name_or_path!r}; built-in: {', '.join(builtin_names())}")
        text = candidate.read_text()
    return parse(read_yaml(text), default_name=path.stem)  # keys remember their lines


_TOP = {"name", "description", "model", "fleet", "streams", "duration_s", "warmup_s", "slo", "events",
        "strategies", "gateway", "engine", "autoscale", "profiling"}


def parse(raw: Any, default_name: str = "scenario") -> Scenario:
    if not isinstance(raw, dict):
        raise ValueError("a scenario is a YAML mapping")
    extra = set(raw) - _TOP
    if extra:
        raise ValueError(f"unknown scenario keys {sorted(extra)}")
    model = str(raw.get("model", "llama2-7b"))
    get_model(model)  # unknown presets fail here, not mid-run
    groups = tuple(_group(g, i) for i, g in enumerate(_list(raw, "fleet")))
    if not groups:
        raise ValueError("fleet: at least one group of replicas")
    streams = tuple(_stream(s, i) for i, s in enumerate(_list(raw, "streams")))
    if not streams:
        raise ValueError("streams: at least one arrival stream")
    duration = float(raw.get("duration_s", 600))
    warmup = float(raw.get("warmup_s", min(60.0, duration / 4)))
    if duration <= 0 or not 0 <= warmup < duration:
        raise ValueError("need duration_s > 0 and 0 <= warmup_s < duration_s")
    changes, losses = _events(raw.get("events") or [], {g.gpu for g in groups})
    unknown = {c.stream for c in changes} - {s.name for s in streams} - {None}
    if unknown:
        raise ValueError(f"events: no stream named {sorted(unknown)}")
    autoscale = _autoscale(raw["autoscale"]) if raw.get("autoscale") is not None else None
    slo = _slo(raw.get("slo") or {})
    gw = raw.get("gateway") or {}
    timing = GatewayTiming(**{k: float(v) for k, v in gw.items()})
    strategies = raw.get("strategies") or list(DEFAULT_STRATEGIES)
    max_budget, margin = _profiling(raw.get("profiling"))
    return Scenario(
        name=str(raw.get("name", default_name)), model=model, groups=groups, streams=streams,
        duration_s=duration, warmup_s=warmup, slo=slo, rate_changes=changes, losses=losses,
        strategies=tuple(str(s) for s in strategies), timing=timing, engine=dict(raw.get("engine") or {}),
        description=str(raw.get("description", "")).strip(), autoscale=autoscale,
        profile_max_budget=max_budget, profile_budget_margin=margin)


def _profiling(raw: Any) -> tuple[int | None, float]:
    """`profiling: {max_budget: N, budget_margin: M}`: how the virtual profiles are measured (`benchmark
    --admitted --max-budget N`, `gen-profile --budget-margin M`)."""
    if raw is None:
        return None, BUDGET_MARGIN
    if not isinstance(raw, dict) or set(raw) - {"max_budget", "budget_margin"}:
        raise ConfigError("profiling: expected a mapping with max_budget and budget_margin only")
    v = raw.get("max_budget")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ConfigError(f"profiling.max_budget{line_of(raw, 'max_budget')}: expected an integer >= 1, "
                          f"got {v!r}")
    m = raw.get("budget_margin", BUDGET_MARGIN)
    if isinstance(m, bool) or not isinstance(m, int | float) or not math.isfinite(m) or m < 1:
        raise ConfigError(f"profiling.budget_margin{line_of(raw, 'budget_margin')}: expected a number >= 1, "
                          f"got {m!r}")
    return v, float(m)


SCHEDULE_KEYS = frozenset({"interval_s", "window_s", "stabilization_s"})  # with POLICY_KEYS (provision_s)


def _autoscale(raw: Any) -> Autoscale:
    """The loop's schedule and the optimizer's policy keys; a bad one refuses the scenario, named."""
    if not isinstance(raw, dict):
        raise ConfigError("autoscale: expected a mapping")
    policy = parse_policy(raw, "autoscale", SCHEDULE_KEYS | POLICY_KEYS)
    schedule: dict[str, float] = {}
    for key in SCHEDULE_KEYS & set(raw):
        v, positive = raw[key], key == "interval_s"
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0 or (positive and v <= 0):
            raise ConfigError(f"autoscale.{key}{line_of(raw, key)}: expected a number "
                              f"{'> 0' if positive else '>= 0'}, got {v!r}")
        schedule[key] = float(v)
    auto = Autoscale(provision_s=policy.provision_s, policy=policy, **schedule)
    if auto.window_s < auto.interval_s:
        raise ConfigError(f"autoscale.window_s{line_of(raw, 'window_s')}: {auto.window_s:g} is shorter than "
                          f"interval_s {auto.interval_s:g}")
    return auto


def _list(raw: dict[str, Any], key: str) -> list[Any]:
    value = raw.get(key) or []
    if not isinstance(value, list):
        raise ValueError(f"{key}: expected a list")
    return value


def _group(raw: Any, i: int) -> Group:
    if not isinstance(raw, dict) or "gpu" not in raw:
        raise ValueError(f"fleet[{i}]: needs gpu and replicas")
    gpu = get_gpu(str(raw["gpu"])).name  # canonical preset name: aliases group together
    replicas = int(raw.get("replicas", 1))
    if replicas < 1:
        raise ValueError(f"fleet[{i}]: replicas >= 1")
    tp = raw.get("tensor_parallel")
    initial = raw.get("initial")
    minimum, cost = int(raw.get("min_replicas", 0)), float(raw.get("cost", 1.0))
    if initial is not None and not 0 <= int(initial) <= replicas:
        raise ValueError(f"fleet[{i}]: 0 <= initial <= replicas")
    if not 0 <= minimum <= replicas or cost < 0:
        raise ValueError(f"fleet[{i}]: 0 <= min_replicas <= replicas and cost >= 0")
    return Group(gpu, replicas, str(raw.get("name", gpu.lower())), int(tp) if tp else None,
                 int(initial) if initial is not None else None, minimum, cost)


def _stream(raw: Any, i: int) -> Stream:
    if not isinstance(raw, dict):
        raise ValueError(f"streams[{i}]: expected a mapping")
    name = str(raw.get("name", f"stream{i}"))
    rate = float(raw.get("rate", 0))
    if rate <= 0:
        raise ValueError(f"streams[{i}] ({name}): rate > 0")
    mt = raw.get("max_tokens")
    return Stream(name, rate, parse_lengths(raw.get("prompt"), f"{name}.prompt"),
                  parse_lengths(raw.get("output"), f"{name}.output"), int(mt) if mt else None,
                  _prefix(raw.get("prefix"), name))


def _prefix(raw: Any, name: str) -> SharedPrefix | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - {"groups", "tokens", "skew"}:
        raise ValueError(f"{name}.prefix: a mapping of groups, tokens, skew")
    groups, skew = int(raw.get("groups", 0)), float(raw.get("skew", 1.0))
    if groups < 1 or skew < 0:
        raise ValueError(f"{name}.prefix: groups >= 1 and skew >= 0")
    return SharedPrefix(groups, parse_lengths(raw.get("tokens"), f"{name}.prefix.tokens"), skew)


def _events(raw: list[Any], gpus: set[str]) -> tuple[tuple[RateChange, ...], tuple[ReplicaLoss, ...]]:
    changes: list[RateChange] = []
    losses: list[ReplicaLoss] = []
    for i, e in enumerate(raw):
        kind = e.get("kind") if isinstance(e, dict) else None
        if kind == "rate":
            start, end = float(e["at"]), float(e["until"])
            if end <= start or float(e["factor"]) < 0:
                raise ValueError(f"events[{i}]: need until > at and factor >= 0")
            stream = e.get("stream")
            changes.append(RateChange(start, end, float(e["factor"]), str(stream) if stream else None))
        elif kind == "lose-replicas":
            gpu = get_gpu(str(e["gpu"])).name
            if gpu not in gpus:
                raise ValueError(f"events[{i}]: no {gpu} replicas in the fleet")
            fraction = float(e["fraction"])
            if not 0 < fraction <= 1:
                raise ValueError(f"events[{i}]: 0 < fraction <= 1")
            losses.append(ReplicaLoss(float(e["at"]), gpu, fraction))
        else:
            raise ValueError(f"events[{i}]: kind is 'rate' or 'lose-replicas'")
    return tuple(changes), tuple(losses)


def _slo(raw: Any) -> Slo:
    if not isinstance(raw, dict):
        raise ValueError("slo: expected a mapping")
    extra = set(raw) - set(SLO_KEYS)
    if extra:  # silently ignored, a misspelt target would be a run with no SLO at all
        raise ValueError(f"slo: unknown keys {sorted(extra)} (known: {', '.join(SLO_KEYS)})")
    targets: dict[str, float | None] = {}
    for key, v in raw.items():
        try:
            targets[key] = target = _opt_float(v)
        except (TypeError, ValueError):
            target = math.nan
        if target is not None and not target > 0:
            raise ValueError(f"slo: {key} must be a number of seconds > 0, not {v!r}")
    return Slo(**targets)


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)

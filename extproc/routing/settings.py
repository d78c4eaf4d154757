"""Routing settings: defaults, the seed's AIBRIX_* environment variables, per-model overrides, validation.

Pure and dependency-free (config.py calls in here; nothing here imports config), so a bad value is found
when a config is loaded, never on a request. Every error names the key or variable at fault. A strategy's
own section (routing.prefix_cache, routing.slo) is declared by the strategy (params.py) and parsed here
with the rest.

Precedence, highest first: our own EXTPROC_* variable, its AIBRIX_* alias, the YAML file, the default.
A value of 0 is valid everywhere (AIBrix's env parsing treats <= 0 as unset; we do not copy that).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from extproc.routing.params import sections

MAX_WEIGHT = 1_000_000          # the Gateway API's backendRef weight range, as AIBrix uses it
DEFAULT_STRATEGY = "load-balance"
DEFAULT_CACHE_SIZE = 1024       # compiled (strategy header, model) pairs kept; clients choose header values


class SettingError(ValueError):
    """A routing setting is invalid; the message names the key or environment variable."""


@dataclass(slots=True, frozen=True)
class LoadBalanceSettings:
    """The load-balance score's knobs and the imbalance gate's (AIBrix keeps both under loadBalance)."""

    queued_weight: float = 0.0        # λ: running already counts engine-queued requests
    kv_pressure_alpha: float = 2.0    # α
    kv_critical_free: float = 0.10    # below this free-KV fraction a pod scores +Inf
    imbalance_factor: float = 2.0
    imbalance_min_gap: float = 8.0    # in requests (capacity-normalised)
    capacity: str = "speed"           # what the score divides by: speed at load, or AIBrix's observed rate
    # The engines' --max-num-seqs (vLLM's default): a pod with this many in flight would queue the next
    # request in its engine, so it ranks below every pod with a free slot. 0 turns that rule off.
    max_num_seqs: int = 256


CAPACITY_MODES = ("speed", "observed")


@dataclass(slots=True, frozen=True)
class AutoBlendSettings:
    """Weights silently blended behind a requested strategy (AIBrix's AIBRIX_ROUTING_AUTO_BLEND_*)."""

    load_balance_weight: int = 1      # 0 turns auto-blend off altogether, as in AIBrix
    least_request_weight: int = 1
    prefix_cache_weight: int = 5      # a bare `prefix-cache` becomes prefix-cache:5,load-balance:4
    prefix_cache_load_balance_weight: int = 4


@dataclass(slots=True, frozen=True)
class ModelRouting:
    load_balance: LoadBalanceSettings = LoadBalanceSettings()
    auto_blend: AutoBlendSettings = AutoBlendSettings()


@dataclass(slots=True)
class RoutingSettings:
    """The `routing:` section, typed. Strategies get it, as their model sees it, in a BuildContext."""

    seed: int | None = None
    default_strategy: str = DEFAULT_STRATEGY
    load_balance: LoadBalanceSettings = LoadBalanceSettings()
    auto_blend: AutoBlendSettings = AutoBlendSettings()
    models: Mapping[str, ModelRouting] = field(default_factory=dict)
    cache_size: int = DEFAULT_CACHE_SIZE
    # strategy-owned sections (params.py), parsed: routing key -> that strategy's typed settings
    params: Mapping[str, object] = field(default_factory=dict)

    def for_model(self, model: str) -> RoutingSettings:
        """These settings as one model sees them (its routingConfig over the global values)."""
        own = self.models.get(model)
        if own is None:
            return self
        return replace(self, load_balance=own.load_balance, auto_blend=own.auto_blend)


# (section, key) -> environment variables, our own first: the first one set wins.
_LB_KEYS = {  # YAML key (routing.load_balance.*) -> (per-model camelCase key, env suffix, kind)
    "queued_weight": ("queuedWeight", "LOAD_BALANCE_QUEUED_WEIGHT", float),
    "kv_pressure_alpha": ("kvPressureAlpha", "LOAD_BALANCE_KV_PRESSURE_ALPHA", float),
    "kv_critical_free": ("kvCriticalFree", "LOAD_BALANCE_KV_CRITICAL_FREE", float),
    "imbalance_factor": ("imbalanceFactor", "LOAD_BALANCE_IMBALANCE_FACTOR", float),
    "imbalance_min_gap": ("imbalanceMinGap", "LOAD_BALANCE_IMBALANCE_MIN_GAP", float),
    "max_num_seqs": ("maxNumSeqs", "LOAD_BALANCE_MAX_NUM_SEQS", int),
}
_AB_KEYS = {  # routing.auto_blend.* -> (per-model key, env suffix, kind)
    "load_balance_weight": ("loadBalanceWeight", "ROUTING_AUTO_BLEND_LOAD_BALANCE_WEIGHT", int),
    "least_request_weight": ("leastRequestWeight", "ROUTING_AUTO_BLEND_LEAST_REQUEST_WEIGHT", int),
    "prefix_cache_weight": ("prefixCacheWeight", "ROUTING_AUTO_BLEND_PREFIX_CACHE_WEIGHT", int),
    "prefix_cache_load_balance_weight": ("prefixCacheLoadBalanceWeight",
                                         "ROUTING_AUTO_BLEND_PREFIX_CACHE_LOAD_BALANCE_WEIGHT", int),
}
_CORE_KEYS = frozenset({"default_strategy", "seed", "load_balance", "auto_blend", "cache_size"})


def known_keys() -> dict[str, frozenset[str]]:
    """The keys each routing section takes, as the file spells them: the config loader names an unknown
    one with its line and the closest known key (strategies must be registered: extproc.strategies)."""
    return {"routing": _CORE_KEYS | sections().keys(),
            "routing.load_balance": frozenset(_LB_KEYS) | {"capacity"},
            "routing.auto_blend": frozenset(_AB_KEYS)}


def env_knobs() -> dict[str, str]:
    """Each knob's environment suffix (EXTPROC_ and AIBRIX_ go before it) -> the config key it sets."""
    return {suffix: f"routing.{section}.{key}"
            for section, keys in (("load_balance", _LB_KEYS), ("auto_blend", _AB_KEYS))
            for key, (_, suffix, _) in keys.items()}


def env_variables() -> list[str]:
    """Every environment variable read here (for docs and `--help`)."""
    return [f"{prefix}_{suffix}" for suffix in env_knobs() for prefix in ("EXTPROC", "AIBRIX")]


def merge_env(routing: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """The routing section with environment values folded in (a copy). EXTPROC_X beats AIBRIX_X."""
    out = dict(routing)
    for section, keys in (("load_balance", _LB_KEYS), ("auto_blend", _AB_KEYS)):
        merged = dict(_mapping(out.get(section), f"routing.{section}"))
        for key, (_, suffix, kind) in keys.items():
            for var in (f"EXTPROC_{suffix}", f"AIBRIX_{suffix}"):
                if var in env:
                    value = _env_value(var, env[var], kind)
                    _check(section, key, value, var)
                    merged[key] = value
                    break
        if merged:
            out[section] = merged
    return out


def parse_settings(routing: Mapping[str, Any],
                   model_routing: Mapping[str, Mapping[str, Any]] | None = None) -> RoutingSettings:
    """Validate the (env-merged) routing section and each model's `routingConfig`; raise SettingError."""
    routing = _mapping(routing, "routing")
    owned = sections()
    for key in routing:
        if key not in _CORE_KEYS and key not in owned:
            known = ", ".join(sorted(_CORE_KEYS | owned.keys()))
            raise SettingError(f"routing.{key} is not a routing setting (known: {known})")
    seed = routing.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise SettingError(f"routing.seed must be an integer, not {seed!r}")
    cache_size = routing.get("cache_size", DEFAULT_CACHE_SIZE)
    if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
        raise SettingError(f"routing.cache_size must be an integer >= 1, not {cache_size!r}")
    lb = _load_balance(LoadBalanceSettings(), routing.get("load_balance"), "routing.load_balance", snake=True)
    ab = _auto_blend(AutoBlendSettings(), routing.get("auto_blend"), "routing.auto_blend", snake=True)
    models: dict[str, ModelRouting] = {}
    for model, raw in (model_routing or {}).items():
        where = f"models.{model}.routingConfig"
        raw = _mapping(raw, where)
        for key in raw:
            if key not in ("loadBalance", "autoBlend"):
                raise SettingError(f"{where}.{key} is not a routing setting (known: autoBlend, loadBalance)")
        if raw:
            models[model] = ModelRouting(
                _load_balance(lb, raw.get("loadBalance"), f"{where}.loadBalance", snake=False),
                _auto_blend(ab, raw.get("autoBlend"), f"{where}.autoBlend", snake=False))
    default = routing.get("default_strategy", DEFAULT_STRATEGY)
    if not isinstance(default, str) or not default.strip():
        raise SettingError(f"routing.default_strategy must be a strategy name, not {default!r}")
    params = {key: section.parse(routing.get(key)) for key, section in owned.items()}
    return RoutingSettings(seed=seed, default_strategy=default.strip().lower(), load_balance=lb,
                           auto_blend=ab, models=models, cache_size=cache_size, params=params)


def _load_balance(base: LoadBalanceSettings, raw: Any, where: str, *, snake: bool) -> LoadBalanceSettings:
    raw = dict(_mapping(raw, where))
    mode = raw.pop("capacity", None)  # the one word-valued knob (the same key in both spellings)
    if mode is not None:
        if mode not in CAPACITY_MODES:
            raise SettingError(f"{where}.capacity must be one of {', '.join(CAPACITY_MODES)}, not {mode!r}")
        base = replace(base, capacity=mode)
    values = _values(raw, where, _LB_KEYS, snake)
    for key, value in values.items():
        _check("load_balance", key, value, f"{where}.{key if snake else _LB_KEYS[key][0]}")
    return replace(base, **values)


def _auto_blend(base: AutoBlendSettings, raw: Any, where: str, *, snake: bool) -> AutoBlendSettings:
    values = _values(raw, where, _AB_KEYS, snake)
    for key, value in values.items():
        _check("auto_blend", key, value, f"{where}.{key if snake else _AB_KEYS[key][0]}")
    return replace(base, **values)


def _check(section: str, key: str, value: float, name: str) -> None:
    """Range rules, shared by file and environment values; `name` is what the error points at."""
    if section == "auto_blend":
        if not 0 <= value <= MAX_WEIGHT:
            raise SettingError(f"{name} must be an integer from 0 to {MAX_WEIGHT}, not {value!r}")
        return
    ceiling = 1.0 if key == "kv_critical_free" else math.inf
    if not (math.isfinite(value) and 0 <= value <= ceiling):
        bound = "between 0 and 1" if ceiling == 1.0 else "a finite number >= 0"
        raise SettingError(f"{name} must be {bound}, not {value!r}")


def _values(raw: Any, where: str, keys: Mapping[str, tuple[str, str, type]], snake: bool) -> dict[str, Any]:
    """The recognised keys of one section, type-checked (ints for weights, numbers for knobs)."""
    by_name = {(key if snake else camel): (key, kind) for key, (camel, _, kind) in keys.items()}
    out: dict[str, Any] = {}
    for name, value in _mapping(raw, where).items():
        if name not in by_name:
            raise SettingError(f"{where}.{name} is not a setting (known: {', '.join(sorted(by_name))})")
        key, kind = by_name[name]
        numeric = isinstance(value, int) if kind is int else isinstance(value, int | float)
        if isinstance(value, bool) or not numeric:
            wanted = "an integer" if kind is int else "a number"
            raise SettingError(f"{where}.{name} must be {wanted}, not {value!r}")
        out[key] = kind(value)
    return out


def _env_value(var: str, text: str, kind: type) -> float | int:
    try:
        return kind(text.strip())
    except ValueError:
        wanted = "an integer" if kind is int else "a number"
        raise SettingError(f"{var}={text!r} is not {wanted}") from None


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SettingError(f"{where} must be a mapping, not {value!r}")
    return value

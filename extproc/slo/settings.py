"""`routing.slo`: the SLO family's settings, typed and checked (pure); the slo* strategies own this section.

    routing:
      slo:
        profiles: [profiles/a10.json, profiles/l20.json]   # AIBrix JSON; Redis aibrix:profile_* too
        max_queue: 256              # waiting requests per model (beyond: 429 queue_full)
        max_wait_seconds: 60        # the longest wait (Envoy's ext_proc message timeout exceeds it)
        predictor_window_seconds: 240
        predictor_slot_seconds: 10
        default_output_tokens: 256
        profile_refresh_seconds: 10
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.routing.params import Params
from extproc.routing.settings import SettingError

# The ext_proc message timeout the Envoy bootstrap sets is derived from this ceiling (envoy_bootstrap).
MAX_WAIT_CEILING_SECONDS = 240.0


@dataclass(slots=True, frozen=True)
class SloSettings:
    max_queue: int = 256             # waiting requests per model; beyond it: 429 queue_full
    max_wait_seconds: float = 60.0   # the longest any request waits (Envoy's message timeout exceeds it)
    window_seconds: float = 240.0    # the output predictor's window (AIBrix: 240 s)
    slot_seconds: float = 10.0       # ... rotated every 10 s
    default_output_tokens: int = 256  # predicted output with no history and no max_tokens
    profile_refresh_seconds: float = 10.0
    profiles: tuple[str, ...] = ()   # profile files (AIBrix JSON); Redis `aibrix:profile_*` too


SLO_KEYS = {  # key -> (SloSettings field, kind, minimum, maximum)
    "max_queue": ("max_queue", int, 0, 1_000_000),
    "max_wait_seconds": ("max_wait_seconds", float, 0.001, MAX_WAIT_CEILING_SECONDS),
    "predictor_window_seconds": ("window_seconds", float, 1.0, 86_400.0),
    "predictor_slot_seconds": ("slot_seconds", float, 0.1, 3_600.0),
    "default_output_tokens": ("default_output_tokens", int, 1, 1 << 20),
    "profile_refresh_seconds": ("profile_refresh_seconds", float, 0.1, 3_600.0),
}


def parse_slo(raw: Any) -> SloSettings:
    if raw is None:
        return SloSettings()
    if not isinstance(raw, Mapping):
        raise SettingError(f"routing.slo must be a mapping, not {raw!r}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "profiles":
            if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
                raise SettingError(f"routing.slo.profiles must be a list of file paths, not {value!r}")
            values["profiles"] = tuple(value)
            continue
        if key not in SLO_KEYS:
            known = ", ".join(sorted([*SLO_KEYS, "profiles"]))
            raise SettingError(f"routing.slo.{key} is not a setting (known: {known})")
        field, kind, low, high = SLO_KEYS[key]
        numeric = isinstance(value, int) if kind is int else isinstance(value, int | float)
        if isinstance(value, bool) or not numeric or not low <= value <= high:
            wanted = "an integer" if kind is int else "a number"
            raise SettingError(f"routing.slo.{key} must be {wanted} from {low:g} to {high:g}, not {value!r}")
        values[field] = kind(value)
    settings = SloSettings(**values)
    if settings.window_seconds < settings.slot_seconds:
        raise SettingError("routing.slo.predictor_window_seconds must be at least predictor_slot_seconds")
    return settings


PARAMS = Params("slo", parse_slo)  # shared by every slo* strategy

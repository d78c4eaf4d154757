"""Strategy-owned sections of the `routing:` YAML (`routing.prefix_cache`, `routing.slo`, ...).

A strategy declares its section when it registers (`register(name, params=Params(key, parse))`); the
routing settings parser (settings.py) parses every declared section with the rest of `routing:`, so a
bad value refuses the config at load, and the strategy's factory receives it typed (`BuildContext.params`).
Adding a strategy with settings touches neither settings.py nor config.py. Imports nothing of routing:
settings.py sits below the registry and reads the declarations from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Params:
    key: str                        # the section: routing.<key>
    parse: Callable[[Any], object]  # the raw section (None: absent) -> typed settings; raises SettingError


_SECTIONS: dict[str, Params] = {}


def declare(params: Params) -> None:
    """A section for `routing.<key>` (several strategies may share one: the slo family does)."""
    known = _SECTIONS.get(params.key)
    if known is not None and known is not params:
        raise ValueError(f"routing.{params.key} is declared by two strategies")
    _SECTIONS[params.key] = params


def sections() -> Mapping[str, Params]:
    """Every declared section, in declaration order."""
    return _SECTIONS

"""How the optimizer's config and a scenario's autoscale section refuse a bad key: named, with its line and
the known key it is closest to, as the gateway's config does (extproc.config.schema.check_known)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.config.schema import ConfigError as GatewayConfigError
from extproc.config.schema import check_known


class ConfigError(ValueError):
    """An optimizer config that cannot be used; the message names the field."""


def check_keys(where: str, mapping: Mapping[str, Any], allowed: frozenset[str]) -> None:
    try:
        check_known(where, mapping, allowed)
    except GatewayConfigError as e:
        raise ConfigError(str(e)) from None

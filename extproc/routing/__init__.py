"""Pure scheduling core: (Request, [PodView], now) -> Pod. Importing this package registers strategies."""

from extproc.routing import least_request, random_pick  # noqa: F401  (registration side effects)
from extproc.routing.framework import (
    PodView,
    Profile,
    RoutingSettings,
    UnknownStrategy,
    build,
    strategy_names,
)

__all__ = ["PodView", "Profile", "RoutingSettings", "UnknownStrategy", "build", "strategy_names"]

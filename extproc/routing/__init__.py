"""Pure scheduling core: (Request, [PodView], now) -> Pod. Importing this package registers strategies."""

from extproc.routing import least_request, load_balance, random_pick, round_robin  # noqa: F401  (registration)
from extproc.routing.blend import StrategySpec
from extproc.routing.framework import (
    PodView,
    Profile,
    StrategySpecError,
    UnknownStrategy,
    build,
    strategy_names,
)
from extproc.routing.router import Router
from extproc.routing.settings import RoutingSettings, SettingError
from extproc.routing.state import RoutingState

__all__ = ["PodView", "Profile", "Router", "RoutingSettings", "RoutingState", "SettingError", "StrategySpec",
           "StrategySpecError", "UnknownStrategy", "build", "strategy_names"]

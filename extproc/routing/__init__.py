"""Pure scheduling core: (Request, [PodView], now) -> Pod. Importing this package registers its strategies
(extproc.strategies adds the SLO family, which builds on this package)."""

from extproc.routing import (  # noqa: F401  (registration)
    least_kv_cache,
    least_latency,
    least_request,
    load_balance,
    power_of_two,
    prefix_cache,
    random_pick,
    round_robin,
    session_affinity,
    throughput,
)
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
from extproc.routing.store import RoutingState

__all__ = ["PodView", "Profile", "Router", "RoutingSettings", "RoutingState", "SettingError", "StrategySpec",
           "StrategySpecError", "UnknownStrategy", "build", "strategy_names"]

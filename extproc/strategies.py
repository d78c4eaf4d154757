"""Every routing strategy the gateway offers, registered: routing's own (extproc.routing) and the SLO
family (extproc.slo). Import this wherever a strategy may be named by config or a header; routing itself
never imports the slo package, which builds on it."""

import extproc.routing  # noqa: F401  (registers the built-in strategies)
import extproc.slo.strategy  # noqa: F401  (registers slo, slo-pack-load, slo-least-load, slo-least-load-pulling)

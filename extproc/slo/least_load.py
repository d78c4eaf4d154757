"""slo-least-load: the lowest current utilization among pods of suitable types (tput > 0 for the
request's cell), ignoring the SLO prediction."""

from __future__ import annotations

from extproc.slo.policy import SloPolicy


class LeastLoad(SloPolicy):
    name = "slo-least-load"

    def choose(self, request, sig, rows, now, queued):  # noqa: ANN001, ANN201  (SloPolicy.choose)
        return self.best(rows, lambda r: r.utilization)

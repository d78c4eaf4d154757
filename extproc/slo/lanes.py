"""slo, ours: as slo-least-load-pulling, among the GPU types comparative advantage gives the request's
shape (slo/assignment.py: its lane), packed (the fullest pod that fits) on a type the split also gives
a whole-pod shape, so that shape finds an empty pod; a full lane spills packed onto another type; a
whole-pod shape shares a pod; a pod measurement says has room takes a request before it waits; one
queue per lane (docs/slo-routing.md, "Why slo departs")."""

from __future__ import annotations

from extproc.openai import Request
from extproc.pool.pod import deployment_of
from extproc.slo.model import Signature
from extproc.slo.policy import EPS, Row
from extproc.slo.pulling import Pulling


class Lanes(Pulling):
    name = "slo"

    def choose(self, request, sig, rows, now, queued):  # noqa: ANN001, ANN201  (SloPolicy.choose)
        everywhere = rows
        rows = self._assigned(request, sig, rows, now, queued)
        lane = frozenset(deployment_of(r.view.pod) for r in rows)
        spill = [r for r in everywhere if deployment_of(r.view.pod) not in lane
                 and 0.0 < r.utilization and r.utilization + r.consumption <= 1.0 + EPS]
        pack = not lane.isdisjoint(self.state.whole_hosts(request.model))
        return self.pull(request, sig, rows, now, queued, lane, spill, pack)

    def _assigned(self, request: Request, sig: Signature, rows: list[Row], now: float,
                  queued: bool) -> list[Row]:
        """The rows of the deployments the split by comparative advantage gives this shape."""
        state = self.state
        if not queued:  # a queued request was counted in the mix when it arrived
            state.observe_arrival(request.model, sig, now)
        pods: dict[str, int] = {}
        for r in rows:
            dep = deployment_of(r.view.pod)
            pods[dep] = pods.get(dep, 0) + 1
        chosen = state.assigned(request.model, sig, pods, now)
        return [r for r in rows if deployment_of(r.view.pod) in chosen] or rows

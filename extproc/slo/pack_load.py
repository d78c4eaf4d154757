"""slo-pack-load: the pod with the largest utilization + consumption still <= 1 (consolidate); none
fits: the least loaded after placement."""

from __future__ import annotations

from extproc.slo.policy import SloPolicy, fitting


class PackLoad(SloPolicy):
    name = "slo-pack-load"

    def choose(self, request, sig, rows, now, queued):  # noqa: ANN001, ANN201  (SloPolicy.choose)
        fits = fitting(rows)
        if fits:
            return self.best(fits, lambda r: -(r.utilization + r.consumption))
        return self.best(rows, lambda r: r.utilization + r.consumption)

"""What SLO routing learns and keeps across config reloads, one SloState per gateway in RoutingState's
store (key "slo"), shared by every slo* strategy of every model. It holds one object per concern and
says which is which: the profile tables (here), the output predictors (the request's signature, here),
the in-flight consumption ledger (slo/ledger.py), the `slo` rule's split (slo/split.py), the queues
(slo/queue.py). It is itself the post-choice / post-response hook (registered once, whatever number of
strategies use it) and the source of its metric."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from extproc.gpu_profiles import GpuProfile
from extproc.openai import Request
from extproc.pool.pod import Pod, deployment_of
from extproc.routing.store import Series
from extproc.slo.ledger import LEDGER_LIMIT, Ledger
from extproc.slo.model import DeploymentModel, Signature, build_table
from extproc.slo.predictor import OutputPredictor
from extproc.slo.queue import Queues
from extproc.slo.settings import SloSettings
from extproc.slo.split import ASSIGNMENT_REFRESH_S, Split
from extproc.vocabulary import PodView, RequestRecord

STORE_KEY = "slo"  # where the SloState lives in RoutingState.store

__all__ = ["ASSIGNMENT_REFRESH_S", "LEDGER_LIMIT", "STORE_KEY", "SloState", "learned"]


def learned(store: Mapping[object, object]) -> SloState | None:
    """The gateway's SloState, from its RoutingState's store (None until an slo* strategy was built)."""
    return store.get(STORE_KEY)  # type: ignore[return-value]


class SloState:
    def __init__(self, settings: SloSettings | None = None) -> None:
        self.settings = settings or SloSettings()
        self.tables: dict[str, dict[str, DeploymentModel]] = {}
        self._sources: dict[str, dict[str, GpuProfile]] = {}  # what each table was built from
        self._cuts: dict[str, dict[str, float]] = {}  # the optimizer's, per model (slo/fleet_factors.py)
        self.predictors: dict[str, OutputPredictor] = {}
        self.ledger = Ledger()
        self.queues = Queues(self.settings.max_queue)
        self.split = Split()

    def configure(self, settings: SloSettings) -> None:
        self.settings = settings
        self.queues.max_length = settings.max_queue

    # -- profiles ---------------------------------------------------------------------------------

    def set_profiles(self, model: str, profiles: Mapping[str, GpuProfile]) -> None:
        """deployment name -> profile for one model (from files and Redis, newest `created` won)."""
        profiles = dict(profiles)
        if self._sources.get(model) == profiles:
            return  # unchanged: no rebuild, no repeated "estimated" / "left out" log lines
        self._sources[model] = profiles
        self._rebuild(model)

    def set_cuts(self, model: str, cuts: Mapping[str, float]) -> None:
        """The GPU optimizer's feedback cuts for one model (deployment -> factor < 1; {}: none): each cut
        deployment's pods admit that share of their budgets (slo/fleet_factors.py)."""
        cuts = dict(cuts)
        if self._cuts.get(model, {}) == cuts:
            return
        self._cuts[model] = cuts
        if model in self._sources:
            self._rebuild(model)

    def _rebuild(self, model: str) -> None:
        """The model's table from its profiles and cuts; its split is solved again on the new one."""
        self.tables[model] = build_table(self._sources[model], self._cuts.get(model))
        self.split.forget(model)

    def table(self, model: str) -> dict[str, DeploymentModel]:
        return self.tables.get(model) or {}

    # -- the request's signature ------------------------------------------------------------------

    def predictor(self, model: str) -> OutputPredictor:
        p = self.predictors.get(model)
        if p is None:
            s = self.settings
            p = self.predictors[model] = OutputPredictor(s.window_seconds, s.slot_seconds,
                                                         s.default_output_tokens)
        return p

    def signature(self, request: Request, now: float) -> Signature:
        out = self.predictor(request.model).predict(request.prompt_tokens, request.max_tokens, now)
        return Signature(max(1, request.prompt_tokens), out)

    # -- comparative advantage (the `slo` strategy; slo/split.py) ---------------------------------

    def observe_arrival(self, model: str, sig: Signature, now: float) -> None:
        self.split.observe_arrival(model, sig, now)

    def assigned(self, model: str, sig: Signature, pods: Mapping[str, int], now: float) -> frozenset[str]:
        """The deployments the recent mix's split over these pods gives this shape (empty: no opinion)."""
        return self.split.assigned(model, self.table(model), sig, pods, now)

    def whole_hosts(self, model: str) -> frozenset[str]:
        """The deployments the split gives a shape that takes a whole pod (slo/split.py)."""
        return self.split.whole_hosts(model, self.table(model))

    # -- the load model (slo/ledger.py) -----------------------------------------------------------

    def utilization(self, pod: Pod, running: int, fill: float) -> float:
        return self.ledger.utilization(pod, running, fill)

    def consumption(self, request: Request, pod: Pod, now: float) -> float | None:
        dm = self.table(request.model).get(deployment_of(pod))
        if dm is None:
            return None
        return dm.consumption(self.signature(request, now))

    # -- hooks (registered once, through each slo* strategy's hooks_of) ---------------------------

    def post_choice(self, request: Request, chosen, now: float) -> None:
        pod = chosen.pod
        self.ledger.routed(pod, request, self.consumption(request, pod, now) if self.table(request.model)
                           else None)

    def post_serve(self, request: Request, chosen: Pod, served: Pod, now: float) -> None:
        self.ledger.moved(request, chosen, served)

    def post_response(self, record: RequestRecord, now: float) -> None:
        self.ledger.ended(record)
        if record.ok and record.output_tokens and record.prompt_tokens is not None:
            self.predictor(record.model).observe(record.prompt_tokens, record.output_tokens, now)

    def deployment_utilization(self, views) -> dict[tuple[str, str], float]:
        """(model, deployment) -> mean pod utilization, for the metric."""
        sums: dict[tuple[str, str], list[float]] = {}
        for v in views:
            dep = deployment_of(v.pod)
            sums.setdefault((v.pod.model, dep), []).append(self.utilization(v.pod, v.running, 0.0))
        return {k: sum(u) / len(u) for k, u in sums.items()}

    def collect(self, views: Callable[[str], Sequence[PodView]], now: float) -> Iterator[Series]:
        """extproc_slo_utilization{model, deployment}: mean SLO-model utilization of the deployment's pods."""
        samples = [((m, dep), u) for model in self.tables
                   for (m, dep), u in sorted(self.deployment_utilization(views(model)).items())]
        yield Series("extproc_slo_utilization", "Mean utilization of a deployment's pods in SLO routing's "
                     "load model (sum of in-flight consumptions; 1.0 = at the SLO rate)", "gauge",
                     ("model", "deployment"), samples)
        yield Series("extproc_slo_optimizer_cut", "The GPU optimizer's feedback cut a deployment's pods "
                     "admit by: the share of their profile's budget (1 or absent: none)", "gauge",
                     ("model", "deployment"),
                     [((model, dep), f) for model, cuts in sorted(self._cuts.items())
                      for dep, f in sorted(cuts.items())])

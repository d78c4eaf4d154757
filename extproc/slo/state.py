"""What SLO routing learns and keeps across config reloads: profile tables, predictors, the in-flight
consumption ledger, the queue. One SloState per gateway, in RoutingState's store (key "slo"), shared by
every slo* strategy of every model; it is itself the post-choice / post-response hook (registered once,
whatever number of strategies use it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import islice

from extproc.gpu_profiles import GpuProfile
from extproc.openai import Request
from extproc.pool.pod import Pod, deployment_of
from extproc.routing.store import Series
from extproc.slo.assignment import Mix, Shape, assign, shape_of
from extproc.slo.model import DeploymentModel, Signature, build_table
from extproc.slo.predictor import OutputPredictor
from extproc.slo.queue import Queues
from extproc.slo.settings import SloSettings
from extproc.state.record import PodView, RequestRecord

ASSIGNMENT_REFRESH_S = 5.0  # `slo`'s split re-solved in place (no server loop) at most this often
STORE_KEY = "slo"  # where the SloState lives in RoutingState.store
LEDGER_LIMIT = 4096  # consumptions remembered per pod (the newest `running` of them are counted)

Ledger = dict[int, "float | None"]  # id(routed Request) -> its consumption, oldest first


_MISSING = object()


def learned(store: Mapping[object, object]) -> SloState | None:
    """The gateway's SloState, from its RoutingState's store (None until an slo* strategy was built)."""
    return store.get(STORE_KEY)  # type: ignore[return-value]


class SloState:
    def __init__(self, settings: SloSettings | None = None) -> None:
        self.settings = settings or SloSettings()
        self.tables: dict[str, dict[str, DeploymentModel]] = {}
        self._sources: dict[str, dict[str, GpuProfile]] = {}  # what each table was built from
        self.predictors: dict[str, OutputPredictor] = {}
        self.ledger: dict[tuple, Ledger] = {}
        self.queues = Queues(self.settings.max_queue)
        self.mixes: dict[str, Mix] = {}
        self._assignments: dict[str, tuple[float, tuple, dict[Shape, frozenset[str]]]] = {}
        self.split_elsewhere = False  # True while the server's background task keeps the splits fresh

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
        self.tables[model] = build_table(profiles)
        self._assignments.pop(model, None)

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

    # -- comparative advantage (the `slo` strategy) ------------------------------------------------

    def observe_arrival(self, model: str, sig: Signature, now: float) -> None:
        mix = self.mixes.get(model)
        if mix is None:
            mix = self.mixes[model] = Mix()
        mix.observe(shape_of(sig), now)

    def assigned(self, model: str, sig: Signature, pods: Mapping[str, int], now: float) -> frozenset[str]:
        """The deployments the recent mix's split over these pods gives this shape (empty: no opinion).
        Kept fresh by `store_split` off the request path when a server runs it; computed here only when
        nothing else does (the fleet simulation) or before the first split."""
        key = tuple(sorted(pods.items()))
        cached = self._assignments.get(model)
        if cached is None or not self.split_elsewhere and (
                cached[1] != key or not 0 <= now - cached[0] < ASSIGNMENT_REFRESH_S):
            mix = self.mixes.get(model)
            self.store_split(model, key, now, assign(self.table(model), pods, mix.rates(now) if mix else {}))
            cached = self._assignments[model]
        return cached[2].get(shape_of(sig), frozenset())

    def store_split(self, model: str, key: tuple, now: float, split: dict[Shape, frozenset[str]]) -> None:
        self._assignments[model] = (now, key, split)

    # -- the load model ---------------------------------------------------------------------------

    def utilization(self, pod: Pod, running: int, fill: float) -> float:
        """Sum of the pod's in-flight consumptions. `running` (exact, across gateways) says how many;
        the newest that many recorded here are summed, requests this gateway did not see (another
        replica's) count as the mean of the known ones, else as `fill`."""
        if running <= 0:
            return 0.0
        entries = self.ledger.get(pod.key)
        known = [c for c in islice(reversed(entries.values()), running) if c is not None] if entries else []
        mean = sum(known) / len(known) if known else fill
        return sum(known) + (running - len(known)) * mean

    def consumption(self, request: Request, pod: Pod, now: float) -> float | None:
        dm = self.table(request.model).get(deployment_of(pod))
        if dm is None:
            return None
        return dm.consumption(self.signature(request, now))

    # -- hooks (registered once, through each slo* strategy's hooks_of) ---------------------------

    def post_choice(self, request: Request, chosen, now: float) -> None:
        pod = chosen.pod
        entries = self.ledger.setdefault(pod.key, {})
        if len(entries) >= LEDGER_LIMIT:
            del entries[next(iter(entries))]
        # Keyed by the Request object, alive in the gateway's open-request table until its record, so
        # the request that finishes takes its own consumption away: shapes finish out of order.
        entries[id(request)] = self.consumption(request, pod, now) if self.table(request.model) else None

    def post_response(self, record: RequestRecord, now: float) -> None:
        entries = self.ledger.get(record.pod.key)
        if entries:
            if record.request is None or entries.pop(id(record.request), _MISSING) is _MISSING:
                del entries[next(iter(entries))]  # not routed here: the oldest goes
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

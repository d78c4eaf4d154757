"""The service's state: monitored deployments per model, their overrides, and the latest plan (pure).

What a deployment reports, in order: an override (PUT /scale); with no load, its min_replicas; under
load, the plan's count (0 for a type the plan does not use or that has no profile); under load with no
plan yet (no profiles, an unservable cell), its configured replicas, else min_replicas.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from extproc.optimizer.deployments import Deployment
from extproc.optimizer.feedback import Feedback
from extproc.optimizer.solver import Demand, Plan
from extproc.optimizer.workload import Burst

HISTORY_POINTS = 720  # two hours at the 10 s re-plan interval


class NotMonitored(LookupError):
    pass


@dataclass(slots=True)
class ModelState:
    model: str
    deployments: dict[str, Deployment] = field(default_factory=dict)  # "namespace/name" -> deployment
    overrides: dict[str, int] = field(default_factory=dict)
    demands: list[Demand] = field(default_factory=list)
    plan: Plan | None = None  # the last plan that solved; kept when a later solve fails
    error: str | None = None  # why the last re-plan did not produce a plan
    updated: float = 0.0
    planned_at: float | None = None  # the last re-plan that produced a plan, or found no load to plan for
    history: deque[tuple[float, dict[str, int]]] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    feedback: Feedback = field(default_factory=Feedback)  # how each type kept the SLO: the plan's correction
    grew_at: dict[str, float] = field(default_factory=dict)  # deployment -> when its count last rose
    burst: Burst | None = None  # a burst in the last re-plan's newest windows, and what the plan made of it
    held: dict[str, int] | None = None  # the last re-plan's own counts when it kept the fleet running

    @property
    def has_load(self) -> bool:
        return bool(self.demands)

    def reported(self, key: str) -> int:
        """Replicas the deployment should run now (the endpoint serves this × 100)."""
        d = self.deployments[key]
        if key in self.overrides:
            return self.overrides[key]
        if not self.has_load:
            return d.min_replicas
        if self.plan is not None:
            return self.plan.replicas.get(key, 0)
        return d.replicas if d.replicas is not None else d.min_replicas

    def apply(self, now: float, demands: list[Demand], plan: Plan | None, error: str | None,
              burst: Burst | None = None, held: dict[str, int] | None = None) -> None:
        """Record one re-plan: the workload seen, and the plan or the reason there is none."""
        self.demands = demands
        self.burst = burst
        self.held = held
        if plan is not None:
            self.plan = plan
        if plan is not None or not demands:
            self.planned_at = now
        self.error = error
        self.updated = now
        counts = {k: self.reported(k) for k in sorted(self.deployments)}
        if self.history:
            self.grew_at.update((k, now) for k, n in counts.items() if n > self.history[-1][1].get(k, 0))
        self.history.append((now, counts))


class Fleet:
    """Models and their deployments: the source's list, plus POSTed ones, minus DELETEd ones."""

    def __init__(self, new_feedback: Callable[[], Feedback] = Feedback) -> None:
        self.new_feedback = new_feedback  # each model's own, with the policy's figures
        self.models: dict[str, ModelState] = {}
        self._source: dict[str, Deployment] = {}
        self._added: dict[str, Deployment] = {}  # POST /monitor with a body, for deployments the source lacks
        self._stopped: set[str] = set()

    def sync(self, deployments: Iterable[Deployment]) -> None:
        self._source = {d.key: d for d in deployments}
        self._rebuild()

    def _rebuild(self) -> None:
        wanted = {**self._added, **self._source}
        by_model: dict[str, dict[str, Deployment]] = {}
        for key, d in wanted.items():
            if key not in self._stopped:
                by_model.setdefault(d.model, {})[key] = d
        for model in list(self.models):
            if model not in by_model:
                del self.models[model]
        for model, deps in by_model.items():
            state = self.models.get(model) or self.models.setdefault(
                model, ModelState(model, feedback=self.new_feedback()))
            state.deployments = dict(sorted(deps.items()))
            state.overrides = {k: v for k, v in state.overrides.items() if k in deps}

    def known(self, namespace: str, name: str) -> Deployment | None:
        key = f"{namespace}/{name}"
        return self._source.get(key) or self._added.get(key)

    def find(self, namespace: str, name: str) -> tuple[ModelState, Deployment]:
        key = f"{namespace}/{name}"
        for state in self.models.values():
            if key in state.deployments:
                return state, state.deployments[key]
        raise NotMonitored(f"deployment {key} is not monitored")

    def start(self, d: Deployment, *, add: bool) -> bool:
        """Watch a deployment again (or, with add, a new one); True when it was not watched before."""
        was = self._is_watched(d.key)
        self._stopped.discard(d.key)
        if add:
            self._added[d.key] = d
        self._rebuild()
        return not was

    def stop(self, namespace: str, name: str) -> None:
        state, d = self.find(namespace, name)
        self._stopped.add(d.key)
        self._added.pop(d.key, None)
        self._rebuild()

    def _is_watched(self, key: str) -> bool:
        return any(key in s.deployments for s in self.models.values())

    def override(self, namespace: str, name: str, replicas: int) -> None:
        """replicas ≥ 0 pins the deployment; -1 clears every override of its model (AIBrix's rule)."""
        state, d = self.find(namespace, name)
        if replicas < 0:
            state.overrides.clear()
        else:
            state.overrides[d.key] = replicas

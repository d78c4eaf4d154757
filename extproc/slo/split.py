"""The `slo` rule's split: the recent mix of shapes per model, and the GPU types comparative advantage
gives each shape (slo/assignment.py's LP over that mix), cached. A server keeps it fresh off the request
path (slo/refresh.py sets `elsewhere`); otherwise (the fleet simulation, or before the first refresh)
it is re-solved in place at most every ASSIGNMENT_REFRESH_S, or when the pods change."""

from __future__ import annotations

from collections.abc import Mapping

from extproc.slo.assignment import Mix, Shape, assign, shape_of
from extproc.slo.model import DeploymentModel, Signature

ASSIGNMENT_REFRESH_S = 5.0  # `slo`'s split re-solved in place (no server loop) at most this often


class Split:
    def __init__(self) -> None:
        self.mixes: dict[str, Mix] = {}
        self.assignments: dict[str, tuple[float, tuple, dict[Shape, frozenset[str]]]] = {}
        self.elsewhere = False  # True while the server's background task keeps the splits fresh
        self._whole: dict[str, tuple[dict, frozenset[str]]] = {}  # model -> (the split, `whole_hosts`)

    def observe_arrival(self, model: str, sig: Signature, now: float) -> None:
        mix = self.mixes.get(model)
        if mix is None:
            mix = self.mixes[model] = Mix()
        mix.observe(shape_of(sig), now, sig.input_tokens)

    def assigned(self, model: str, table: Mapping[str, DeploymentModel], sig: Signature,
                 pods: Mapping[str, int], now: float) -> frozenset[str]:
        """The deployments the recent mix's split over these pods gives this shape (empty: no opinion)."""
        key = tuple(sorted(pods.items()))
        cached = self.assignments.get(model)
        if cached is None or not self.elsewhere and (
                cached[1] != key or not 0 <= now - cached[0] < ASSIGNMENT_REFRESH_S):
            mix = self.mixes.get(model)
            self.store(model, key, now, assign(table, pods, mix.rates(now) if mix else {}))
            cached = self.assignments[model]
        return cached[2].get(shape_of(sig), frozenset())

    def whole_hosts(self, model: str, table: Mapping[str, DeploymentModel]) -> frozenset[str]:
        """The deployments the current split gives a whole-pod shape (consumption 1: a long prompt a
        pod serves only alone): `slo` packs their other requests so that such a shape finds an empty
        pod. A shape is judged at its representative and at the longest prompt it has held (`Mix`):
        it spans half a doubling either side of the representative, and a profile measured between
        doublings (6,144 tokens) puts its longer prompts in a heavier cell. Worked out once per split."""
        cached = self.assignments.get(model)
        if cached is None:
            return frozenset()
        split = cached[2]
        memo = self._whole.get(model)
        if memo is not None and memo[0] is split:
            return memo[1]
        mix = self.mixes.get(model)
        hosts = set()
        for shape, deployments in split.items():
            prompt, output = shape
            sigs = [Signature(2 ** prompt, 2 ** output)]
            if mix is not None and shape in mix.longest:
                sigs.append(Signature(mix.longest[shape], 2 ** output))
            for name in deployments:
                dm = table.get(name)
                if dm is not None and any(_whole(dm.consumption(sig)) for sig in sigs):
                    hosts.add(name)
        self._whole[model] = (split, frozenset(hosts))
        return self._whole[model][1]

    def store(self, model: str, key: tuple, now: float, split: dict[Shape, frozenset[str]]) -> None:
        self.assignments[model] = (now, key, split)

    def forget(self, model: str) -> None:
        """The model's profiles changed: its split is solved again."""
        self.assignments.pop(model, None)


def _whole(consumption: float | None) -> bool:
    return consumption is not None and consumption >= 1.0 - 1e-9  # DeploymentModel.consumption caps at 1

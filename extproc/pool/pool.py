"""The pool: the pods of every model. A config change builds a new Pool; readers never see it mutate."""

from __future__ import annotations

from collections.abc import Iterable

from extproc.pool.pod import Pod


class Pool:
    def __init__(self, pods: Iterable[Pod] = (), models: Iterable[str] = ()) -> None:
        """`models` lists models known even with no pods, so their requests get 503 rather than 404."""
        by_model: dict[str, list[Pod]] = {m: [] for m in models}
        for pod in pods:
            by_model.setdefault(pod.model, []).append(pod)
        self._by_model = {m: tuple(ps) for m, ps in by_model.items()}
        self._ready = {m: [p for p in ps if p.ready] for m, ps in self._by_model.items()}
        self._by_address = {p.address: p for ps in self._by_model.values() for p in ps}

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def has_model(self, model: str) -> bool:
        return model in self._by_model

    def ready_pods(self, model: str) -> list[Pod]:
        return self._ready.get(model, [])

    def all_pods(self) -> list[Pod]:
        return [p for ps in self._by_model.values() for p in ps]

    def pod_at(self, address: str) -> Pod | None:
        return self._by_address.get(address)

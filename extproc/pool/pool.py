"""The pool: the pods of every model, replaced atomically when discovery (the config file) changes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from extproc.pool.pod import Pod


class Pool:
    """Model name -> pods. Readers get immutable tuples, so a reload never changes a list under them."""

    def __init__(self, pods: Iterable[Pod] = ()) -> None:
        self._by_model: Mapping[str, tuple[Pod, ...]] = {}
        self.replace(pods)

    def replace(self, pods: Iterable[Pod]) -> None:
        by_model: dict[str, list[Pod]] = {}
        for pod in pods:
            by_model.setdefault(pod.model, []).append(pod)
        self._by_model = {m: tuple(ps) for m, ps in by_model.items()}

    def declare(self, model: str) -> None:
        """Make a model known even with no pods, so requests for it get 503 rather than 404."""
        if model not in self._by_model:
            self._by_model = {**self._by_model, model: ()}

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def has_model(self, model: str) -> bool:
        return model in self._by_model

    def pods(self, model: str) -> tuple[Pod, ...]:
        return self._by_model.get(model, ())

    def ready_pods(self, model: str) -> list[Pod]:
        return [p for p in self._by_model.get(model, ()) if p.ready]

    def all_pods(self) -> list[Pod]:
        return [p for ps in self._by_model.values() for p in ps]

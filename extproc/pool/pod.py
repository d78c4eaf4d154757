"""A pod is one serving replica of a model: an engine at an ip:port on some GPU type."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class Pod:
    model: str
    name: str
    address: str  # "ip:port": Envoy's ORIGINAL_DST cluster connects to exactly this
    deployment: str = ""
    labels: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    ready: bool = True

    @property
    def key(self) -> tuple[str, str]:
        return (self.model, self.name)

    @property
    def gpu(self) -> str:
        return self.labels.get("gpu", "")

"""Token-length distributions for generated requests: what a scenario's `prompt:` / `output:` say.

    {dist: lognormal, mean: 250, sigma: 0.8, min: 1, max: 2048}   # heavy right tail, as chat lengths
    {dist: uniform, low: 32, high: 64}                             # both ends included
    {dist: constant, value: 128}

Log-normal is parameterised by its *mean* (what papers quote) and the sigma of the log; clipping to
[min, max] moves the realised mean a little, which the saturation run sees too (it samples the same).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Protocol


class Lengths(Protocol):
    def sample(self, rng: random.Random) -> int: ...

    def describe(self) -> str: ...


@dataclass(frozen=True, slots=True)
class LogNormal:
    mean: float
    sigma: float = 0.8
    low: int = 1
    high: int = 1 << 20

    def sample(self, rng: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma * self.sigma / 2  # so that E[X] = mean before clipping
        return min(self.high, max(self.low, round(rng.lognormvariate(mu, self.sigma))))

    def describe(self) -> str:
        return f"lognormal(mean={self.mean:g}, sigma={self.sigma:g}, [{self.low}, {self.high}])"


@dataclass(frozen=True, slots=True)
class Uniform:
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def describe(self) -> str:
        return f"uniform[{self.low}, {self.high}]"


@dataclass(frozen=True, slots=True)
class Constant:
    value: int

    def sample(self, rng: random.Random) -> int:
        return self.value

    def describe(self) -> str:
        return f"constant {self.value}"


def parse_lengths(raw: Any, where: str) -> Lengths:
    if isinstance(raw, int):
        return Constant(_positive(raw, where))
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping with 'dist', got {raw!r}")
    kind = raw.get("dist", "lognormal")
    known = {"lognormal": {"dist", "mean", "sigma", "min", "max"}, "uniform": {"dist", "low", "high"},
             "constant": {"dist", "value"}}
    if kind not in known:
        raise ValueError(f"{where}: unknown dist {kind!r} (lognormal, uniform, constant)")
    extra = set(raw) - known[kind]
    if extra:
        raise ValueError(f"{where}: unknown keys {sorted(extra)} for {kind}")
    if kind == "lognormal":
        low, high = _positive(raw.get("min", 1), where), _positive(raw.get("max", 1 << 20), where)
        sigma = float(raw.get("sigma", 0.8))
        if high < low or sigma < 0:
            raise ValueError(f"{where}: need min <= max and sigma >= 0")
        return LogNormal(float(_positive(raw["mean"], where)), sigma, low, high)
    if kind == "uniform":
        low, high = _positive(raw["low"], where), _positive(raw["high"], where)
        if high < low:
            raise ValueError(f"{where}: need low <= high")
        return Uniform(low, high)
    return Constant(_positive(raw["value"], where))


def _positive(value: Any, where: str) -> int:
    if not isinstance(value, (int, float)) or value < 1:
        raise ValueError(f"{where}: lengths must be numbers >= 1, got {value!r}")
    return int(value)

"""Speed evidence summed over the fleet: the vector algebra Redis's SPEED script does, in Python.

A gateway's evidence on a pod is `SpeedEstimator.export`: [measured, then per shared group (t, w, x, y,
xx, xy, yy, n)], each group's sums forgotten exponentially with its own horizon (SHARED_TAUS, below).
Forgetting is linear, so sums written at different times add once each is decayed to a common time:
Redis keeps one fleet-wide vector per pod, moved by each gateway's difference to its ledger (as the
in-flight totals are), and a reader gets one vector per pod whatever the number of gateways. Taking a
gateway's share out (it crashed, or left) is the same move with nothing new: its sums leave the total.

Mirrors `redis_scripts.SPEED_MOVE` exactly (the unit tests hold one against the other), and serves the
fleet simulation's in-memory hub and each reader (the fleet's sums less this gateway's own share).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from extproc.pool.pod import PodKey

GROUP = 8                          # (t, w, x, y, xx, xy, yy, n): speed._Sums.vector()
SPEED_VALUES = 1 + 4 * GROUP  # speed.SpeedEstimator.export: when measured, the four shared sums
BASE_TAU = 5.0     # seconds: the horizon of `base` (SpeedEstimator's default)
SHAPE_TAU = 120.0  # seconds: of the slope, the prefill speed and the mix
# Each shared group's horizon, in `export`'s order (_Pod.shared): sums kept fleet-wide in Redis
# (here) are forgotten at these rates, so they add up to what `merge_peers` would make.
SHARED_TAUS = (BASE_TAU, SHAPE_TAU, SHAPE_TAU, SHAPE_TAU)

NEW_RECORDS = 0.5                  # n grown this much beyond its decay: a record arrived since
ROUNDING = 1e-9                    # a sum this small against the terms that made it is 0


_WIRE = struct.Struct(f"<{SPEED_VALUES}d")


def encode(vector: Sequence[float]) -> bytes:
    """Little-endian doubles (Lua's struct library reads them in one call; text cost Redis 5x more)."""
    return _WIRE.pack(*vector)


def decode(raw: bytes | str | None) -> list[float] | None:
    """A vector of the shared width with every value finite, or None. A str is the bytes as the
    client decoded them (RedisState's connection decodes with surrogateescape, which round-trips)."""
    if not raw:
        return None
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogateescape")
    if len(raw) != _WIRE.size:
        return None
    values = list(_WIRE.unpack(raw))
    # A NaN or an infinity anywhere makes the sum one (finite values too large to add are refused too).
    return values if math.isfinite(sum(values)) else None


def move(total: Sequence[float] | None, old: Sequence[float] | None,
         new: Sequence[float] | None) -> list[float] | None:
    """`total` less `old` plus `new`, each group decayed to the latest of their times (sums below 0,
    rounding's, read as 0). None when nothing is left: every sum 0."""
    parts = [v for v in (total, old, new) if v is not None]
    if not parts:
        return None
    out = [max(v[0] for v in parts)]  # last measured: a maximum, kept when a share leaves
    left = False
    for g, tau in enumerate(SHARED_TAUS):
        i = 1 + g * GROUP
        at = max(v[i] for v in parts)
        sums = [0.0] * (GROUP - 1)
        scale = [0.0] * (GROUP - 1)
        for v, sign in ((total, 1.0), (old, -1.0), (new, 1.0)):
            if v is not None:
                f = math.exp(-(at - v[i]) / tau)
                for k in range(GROUP - 1):
                    sums[k] += sign * f * v[i + 1 + k]
                    scale[k] += abs(f * v[i + 1 + k])
        # What rounding leaves of a share taken out is 0.
        sums = [s if s > ROUNDING * m else 0.0 for s, m in zip(sums, scale)]
        left = left or any(sums)
        out.append(at)
        out.extend(sums)
    return out if left else None


def others(total: Sequence[float], own: Sequence[float] | None) -> list[float] | None:
    """The other gateways' evidence: the fleet's sums less this gateway's share as last written."""
    return move(total, own, None) if own is not None else list(total)


def shifted(vector: Sequence[float], by: float) -> list[float]:
    """The vector with its times (measured, each group's t) moved by `by` seconds: gateways share
    evidence on the wall clock, since each one's own clock (monotonic) has its own origin."""
    out = list(vector)
    if len(out) != SPEED_VALUES:  # not evidence: merge_peers drops it
        return out
    out[0] += by
    for g in range(len(SHARED_TAUS)):
        out[1 + g * GROUP] += by
    return out


def new_records(current: Sequence[float], written: Sequence[float] | None) -> bool:
    """Whether a record reached the sums since `written`: some group's count grew beyond what
    forgetting alone leaves (refreshes decay the sums without adding evidence, and move nothing)."""
    if written is None:
        return True
    if len(current) != len(written):
        return True
    for g, tau in enumerate(SHARED_TAUS):
        t = 1 + g * GROUP
        n = t + GROUP - 1
        if current[n] - written[n] * math.exp(-max(0.0, current[t] - written[t]) / tau) >= NEW_RECORDS:
            return True
    return False


def others_many(totals: Sequence[bytes | str], owns: Sequence[bytes | None]) -> list[list[float] | None]:
    """`others` of many pods at once, as lists (None where nothing is left or the total is not a
    vector); `others_matrix` is the same without a Python list per pod."""
    matrix, keep = others_matrix(totals, owns)
    return [row if ok else None for row, ok in zip(matrix.tolist(), keep.tolist())]


def others_matrix(totals: Sequence[bytes | str],
                  owns: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
    """`others` of many pods at once (a read gives every pod's sums: 5,000 of them cost 150 ms one by
    one in Python, a few ms here): (a row per total, whether each row holds evidence). Each total as
    read (bytes, or str as decoded with surrogateescape), each own share as written (encoded) or None.
    A row is kept out where nothing is left or the total is not a vector."""
    width = _WIRE.size
    raw = [t.encode("utf-8", "surrogateescape") if isinstance(t, str) else t for t in totals]
    zero = bytes(width)
    ok = np.fromiter((len(t) == width for t in raw), dtype=bool, count=len(raw))
    total = np.frombuffer(b"".join(t if len(t) == width else zero for t in raw),
                          dtype="<f8").reshape(-1, SPEED_VALUES)
    has_own = np.fromiter((o is not None and len(o) == width for o in owns), dtype=bool, count=len(owns))
    own = np.frombuffer(b"".join(o if o is not None and len(o) == width else zero for o in owns),
                        dtype="<f8").reshape(-1, SPEED_VALUES)
    with np.errstate(all="ignore"):
        ok &= np.isfinite(total).all(axis=1)
        out = np.empty_like(total)
        out[:, 0] = np.where(has_own, np.maximum(total[:, 0], own[:, 0]), total[:, 0])
        left = np.zeros(len(raw), dtype=bool)
        for g, tau in enumerate(SHARED_TAUS):
            i = 1 + g * GROUP
            at = np.where(has_own, np.maximum(total[:, i], own[:, i]), total[:, i])
            ft = np.exp((total[:, i] - at) / tau)[:, None]
            fo = np.where(has_own, np.exp((own[:, i] - at) / tau), 0.0)[:, None]
            a, b = ft * total[:, i + 1:i + GROUP], fo * own[:, i + 1:i + GROUP]
            sums = a - b
            sums = np.where(sums > ROUNDING * (np.abs(a) + np.abs(b)), sums, 0.0)
            left |= (sums > 0).any(axis=1)
            out[:, i] = at
            out[:, i + 1:i + GROUP] = sums
    return out, ok & left


class PeerSums(Mapping):
    """The other gateways' evidence, one summed vector per pod (RedisState's read): the rows of one
    array, so a read costs no Python object per pod. As a mapping it is what `peer_speed` promises
    (pod -> [vector]); the speed fit takes the array whole (SpeedEstimator.merge_peer_sums)."""

    __slots__ = ("rows", "matrix")

    def __init__(self, rows: dict[PodKey, int], matrix: np.ndarray) -> None:
        self.rows = rows        # pod -> its row
        self.matrix = matrix    # (rows, SPEED_VALUES): times on the wall clock

    def __getitem__(self, key: PodKey) -> list[list[float]]:
        return [self.matrix[self.rows[key]].tolist()]

    def __iter__(self) -> Iterator[PodKey]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, key: object) -> bool:
        return key in self.rows

    def pop(self, key: PodKey, default: object = None) -> object:
        """The pod left the pool: its row stays in the array, unreachable."""
        return default if self.rows.pop(key, None) is None else key

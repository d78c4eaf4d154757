"""A model's running totals as Redis keeps them packed, and a gateway's map of which pod is where.

Reading 5,000 totals as a hash cost each gateway ~11 ms a turn, nearly all of it turning 5,000
(field, value) replies into Python objects (`extproc bench sync`, 50 × 5,000). The write and reap
scripts (sharing/redis_scripts.py) also keep the totals in one string per model: a 16-character epoch,
then one little-endian int32 per slot. Slots are given out in order and never reused while the keys
live, so a gateway keeps the pod of each slot it has seen and reads only the names of new slots; a
new epoch (the keys were rebuilt) or a shorter list (Redis came back from an older snapshot) starts
its map afresh. A read is then one string, decoded with numpy whatever the number of pods. Keys:
`extproc:packed:{<model>}` (the string), `extproc:slots:{<model>}` (hash "<ns>/<pod>" -> slot, the
scripts' lookup), `extproc:slotnames:{<model>}` (list: the epoch, then each slot's pod, the readers').
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from extproc.pool.pod import PodKey

HEADER_BYTES = 16                 # the epoch: Redis's TIME when the keys were built, "%010d%06d"
VALUE_FORMAT = "<i4"              # Lua struct's format of one slot (numpy's dtype spelled the same)
VALUE_DTYPE = np.dtype("<i4")
# The scripts rebuild the slots afresh once they outnumber twice the busy pods by this many: the string
# stays within 4 bytes x (2 x busy + this) while pods come and go, rebuilt once per this many new pods.
COMPACT_SLACK = 4096


def as_bytes(raw: str | bytes) -> bytes:
    """Redis's reply as sent: RedisState's connection decodes with surrogateescape, which round-trips."""
    return raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw


def encode(epoch: str, values: Sequence[int]) -> bytes:
    """The packed string the scripts build (tests and the bench's checks)."""
    return epoch.encode() + np.asarray(values, dtype=VALUE_DTYPE).tobytes()


def decode(packed: bytes) -> tuple[str, np.ndarray]:
    """(epoch, value per slot) of a packed string."""
    count = max(0, len(packed) - HEADER_BYTES) // VALUE_DTYPE.itemsize
    values = (np.frombuffer(packed, dtype=VALUE_DTYPE, count=count, offset=HEADER_BYTES) if count
              else np.zeros(0, dtype=VALUE_DTYPE))
    return packed[:HEADER_BYTES].decode("ascii", "replace"), values


class SlotMap:
    """One model's slots as this gateway knows them, and which of them it tracks."""

    def __init__(self) -> None:
        self.epoch = ""
        self.names: list[str] = []                   # pod of each slot, in slot order
        self._pods: Mapping[str, PodKey] = {}
        self._slots = np.zeros(0, dtype=np.intp)     # slots of the tracked pods ...
        self._keys: list[PodKey] = []                # ... and their keys, aligned

    def known(self) -> int:
        """Entries of the names list this map holds, the epoch included (0: none, read afresh)."""
        return len(self.names) + 1 if self.epoch else 0

    def reset(self) -> None:
        """Forget the slots (after a failed turn: Redis may be back from an older snapshot)."""
        self.epoch, self.names = "", []
        self._bind()

    def track(self, pods: Mapping[str, PodKey]) -> None:
        """The model's tracked pods changed: "ns/pod" -> key."""
        self._pods = pods
        self._bind()

    def extend(self, start: int, names: Sequence[str]) -> None:
        """The names a read returned, from entry `start` of the list (0: the epoch, then every slot)."""
        if start == 0:
            self.epoch, self.names = (names[0], list(names[1:])) if names else ("", [])
        elif names:
            self.names.extend(names)
        else:
            return
        self._bind()

    def totals(self, packed: bytes, into: dict[PodKey, int]) -> bool:
        """The tracked pods' totals from a packed string read with this map's names; False (nothing
        read) when the string is of another epoch than the map."""
        aligned = self.aligned(packed)
        if aligned is None:
            return False
        keys, values = aligned
        into.update(zip(keys, values.tolist()))
        return True

    def aligned(self, packed: bytes) -> tuple[list[PodKey], np.ndarray] | None:
        """(the tracked pods that have a slot, their totals in that order), or None when the string is
        of another epoch than the map. The list is the same object until the map is bound anew, so a
        reader may keep arrays aligned with it (SyncCore does: a turn touches only what moved)."""
        epoch, values = decode(packed)
        if epoch != self.epoch:
            return None
        slots = self._slots
        if len(slots) and int(slots[-1]) >= len(values):  # slots given out after this string: at 0
            values = np.concatenate([values, np.zeros(int(slots[-1]) + 1 - len(values), VALUE_DTYPE)])
        return self._keys, values[slots]

    def _bind(self) -> None:
        pods = self._pods
        pairs = [(slot, key) for slot, name in enumerate(self.names) if (key := pods.get(name)) is not None]
        self._slots = np.fromiter((s for s, _ in pairs), dtype=np.intp, count=len(pairs))
        self._keys = [key for _, key in pairs]


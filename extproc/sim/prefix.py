"""Automatic prefix caching, as vLLM V1 does it: full KV blocks of a prompt are named by a hash chain.

A block whose hash is already resident is shared instead of recomputed. Blocks stay resident after the
last request using them is gone ("evictable", LRU) until an allocation needs the room. This is what
makes prefix-aware routing pay off: a replica that saw a prompt's prefix prefills only the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(text: str, chars_per_block: int) -> tuple[int, ...]:
    """Hash chain over the full blocks of a prompt text (each hash covers everything before it too)."""
    out: list[int] = []
    h = 0
    for i in range(0, len(text) - chars_per_block + 1, chars_per_block):
        h = hash((h, text[i : i + chars_per_block]))
        out.append(h)
    return tuple(out)


def token_block_hashes(tokens: Sequence[int], block_size: int) -> tuple[int, ...]:
    out: list[int] = []
    h = 0
    for i in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(tokens[i : i + block_size])))
        out.append(h)
    return tuple(out)


class PrefixCache:
    """Reference counts of resident hashed blocks; released blocks wait in LRU order for eviction."""

    __slots__ = ("_refs", "_lru", "in_use")

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}  # hash -> references (> 0) from sequences
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident, unreferenced, oldest first
        self.in_use = 0  # blocks with references

    @property
    def evictable(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[int], limit: int) -> int:
        """How many leading blocks of `hashes` (at most `limit`) are resident."""
        n = 0
        refs, lru = self._refs, self._lru
        for h in hashes[:limit]:
            if h not in refs and h not in lru:
                break
            n += 1
        return n

    def acquire(self, h: int) -> bool:
        """Take a reference to a resident block; False when it is not resident."""
        count = self._refs.get(h)
        if count is not None:
            self._refs[h] = count + 1
            return True
        if h in self._lru:
            del self._lru[h]
            self._refs[h] = 1
            self.in_use += 1
            return True
        return False

    def insert(self, h: int) -> None:
        """A sequence just computed this block: it becomes resident and shared."""
        self._refs[h] = 1
        self.in_use += 1

    def release(self, h: int) -> None:
        count = self._refs[h] - 1
        if count:
            self._refs[h] = count
        else:
            del self._refs[h]
            self.in_use -= 1
            self._lru[h] = None

    def evict(self, n: int) -> int:
        """Drop up to `n` least recently released blocks; returns how many were dropped."""
        dropped = 0
        while dropped < n and self._lru:
            self._lru.popitem(last=False)
            dropped += 1
        return dropped

"""One replica's paged KV cache, counted in blocks (vLLM's KV cache manager, without tensors).

A sequence holds private blocks for what it computed, and shares full prompt blocks by their hash
(`prefix.py`): a shared block stays resident, evictable, once no sequence uses it. Phantom blocks are
held by no sequence: a KV-pressure fault occupies them, so the reported usage reads what was asked.
The engine (`engine.py`) decides who gets blocks and when; this module only keeps the books.
"""

from __future__ import annotations

import math

from extproc.sim.perf import blocks_for
from extproc.sim.prefix import PrefixCache
from extproc.sim.sequences import SeqState


class KvCache:
    def __init__(self, total_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.used_blocks = 0  # private blocks; shared ones are counted by self.prefix
        self.prefix = PrefixCache()
        self.phantom_blocks = 0

    @property
    def usable_tokens(self) -> int:
        """Tokens the cache could hold for sequences: everything but the phantom blocks."""
        return (self.total_blocks - self.phantom_blocks) * self.block_size

    @property
    def usage(self) -> float:
        """Fraction 0..1 in use (min(): raising the pressure can overbook until preemption frees blocks)."""
        busy = self.used_blocks + self.prefix.in_use + self.phantom_blocks
        return min(1.0, busy / self.total_blocks)

    def set_pressure(self, fraction: float) -> None:
        # ceil: the reported usage must read >= the requested pressure.
        self.phantom_blocks = min(self.total_blocks - 1, math.ceil(self.total_blocks * max(0.0, fraction)))

    def available(self) -> int:
        """Blocks free or held only by the prefix cache's evictable entries."""
        return self.total_blocks - self.phantom_blocks - self.used_blocks - self.prefix.in_use

    def allocate(self, seq: SeqState, tokens: int) -> bool:
        """Blocks for `seq` to hold `tokens`; cached-but-unused prefix blocks are the first to go."""
        need = blocks_for(tokens, self.block_size) - seq.num_blocks - len(seq.hashed)
        if need <= 0:
            return True
        if not self._take(need):
            return False
        seq.num_blocks += need
        return True

    def grant(self, seqs: list[SeqState]) -> None:
        """One block each (the caller checked `available()`): what `allocate` does one by one, at
        once; in any order the same blocks are taken and the same LRU prefix blocks evicted."""
        self._take(len(seqs))
        for seq in seqs:
            seq.num_blocks += 1

    def _take(self, n: int) -> bool:
        free = self.available() - self.prefix.evictable
        if free < n:
            free += self.prefix.evict(min(n - free, self.prefix.evictable))
            if free < n:
                return False
        self.used_blocks += n
        return True

    def release(self, seq: SeqState) -> None:
        self.used_blocks -= seq.num_blocks
        seq.num_blocks = 0
        for h in seq.hashed:
            self.prefix.release(h)  # stays resident (evictable) for the next request with this prefix
        seq.hashed = []

    def reuse_prefix(self, seq: SeqState) -> int:
        """On admission: share the resident leading blocks of the prompt; returns the tokens skipped."""
        hashes = seq.request.block_hashes
        if not hashes or not self.prefix_caching or seq.num_computed:
            return 0
        bs = self.block_size
        # At least one token is always computed: its logits produce the next token (as in vLLM).
        k = self.prefix.match(hashes, min(len(hashes), (seq.total_tokens - 1) // bs))
        for h in hashes[:k]:
            self.prefix.acquire(h)
        seq.hashed = list(hashes[:k])
        seq.num_computed = k * bs
        return k * bs

    def register_prefix(self, seq: SeqState) -> None:
        """Full prompt blocks just computed become shared, named by their hash."""
        hashes = seq.request.block_hashes
        full = min(len(hashes), min(seq.num_computed, seq.request.prompt_tokens) // self.block_size)
        prefix = self.prefix
        while len(seq.hashed) < full:
            h = hashes[len(seq.hashed)]
            seq.num_blocks -= 1  # the private block becomes (or joins) the shared one
            self.used_blocks -= 1
            if not prefix.acquire(h):
                prefix.insert(h)
            seq.hashed.append(h)


__all__ = ["KvCache"]

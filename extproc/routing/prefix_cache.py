"""`prefix-cache`: send a prompt where its longest prefix was recently served, so the engine's prefix
cache (vLLM's automatic prefix caching, SGLang's radix cache) skips that part of the prefill.

The prompt as routing sees it (chat messages rendered in order, `openai.Request.prompt`) is cut into
blocks of `block_tokens` tokens (at ~4 characters per token) and hashed as a chain: block i's hash
covers blocks 0…i, so equal hashes mean equal prefixes. A per-model table remembers which pods served
which block hashes, least recently used first out, bounded by `table_bytes`. A pod's score is the
fraction of the prompt's blocks it holds as an unbroken prefix.

It yields to load: a pod whose capacity-normalised load is well above the least-loaded pod's (the
imbalance gate's rule, per pod) gets no affinity, so the request goes elsewhere — and the pod chosen
then becomes affine too. Routed alone it adds nothing else; `prefix-cache` in a header is auto-blended
as `prefix-cache:5,load-balance:4`, which is how it is meant to run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.openai import CHARS_PER_TOKEN, Request
from extproc.pool.pod import PodKey
from extproc.routing.framework import BuildContext, MaxScorePicker, PodView, Profile, register
from extproc.routing.load_math import overloaded
from extproc.routing.params import Params
from extproc.routing.settings import LoadBalanceSettings, SettingError
from extproc.routing.store import Series

# What the table costs in memory, measured with tracemalloc on CPython 3.11 and rounded up so that the
# byte cap holds: a block held by one pod (int key, OrderedDict link, a small dict) ~361 bytes; each
# further pod holding it grows that dict by ~18-27 bytes and adds a timestamp (24).
ENTRY_BYTES = 400
HOLDER_BYTES = 64


@dataclass(slots=True, frozen=True)
class PrefixCacheSettings:
    """`routing.prefix_cache`: how prompts are cut into blocks and how much the table may hold."""

    block_tokens: int = 64                   # tokens per hashed block (at ~4 characters per token)
    max_blocks: int = 512                    # blocks hashed per prompt: the first 32k tokens
    table_bytes: int = 64 * 1024 * 1024      # memory cap of one model's table (LRU beyond it)


_KEYS = {"block_tokens": (1, 1 << 20), "max_blocks": (1, 1 << 20), "table_bytes": (1 << 16, 1 << 40)}


def parse_settings(raw: Any) -> PrefixCacheSettings:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise SettingError(f"routing.prefix_cache must be a mapping, not {raw!r}")
    values = {}
    for key, value in raw.items():
        if key not in _KEYS:
            raise SettingError(f"routing.prefix_cache.{key} is not a setting "
                               f"(known: {', '.join(sorted(_KEYS))})")
        low, high = _KEYS[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise SettingError(f"routing.prefix_cache.{key} must be an integer from {low} to {high}, "
                               f"not {value!r}")
        values[key] = value
    return PrefixCacheSettings(**values)


PARAMS = Params("prefix_cache", parse_settings)


def block_hashes(text: str, block_tokens: int, max_blocks: int) -> list[int]:
    """Chained hashes of the prompt's full blocks (a partial last block is not cacheable)."""
    size = block_tokens * CHARS_PER_TOKEN
    count = min(len(text) // size, max_blocks)
    out, h = [], 0
    for i in range(count):
        h = hash((h, text[i * size:(i + 1) * size]))
        out.append(h)
    return out


class PrefixTable:
    """Block hash -> {pod: last used}; least recently used blocks evicted while the estimated size is
    over `max_bytes`. A block every pod serves (a common system prompt) costs more than one a single pod
    holds, so holders are counted, not only blocks."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[int, dict[PodKey, float]] = OrderedDict()
        self._holders = 0  # (block, pod) pairs
        self.pods: set[PodKey] = set()  # every pod inserted since the last forget_pods (cheap to check)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def size_bytes(self) -> int:
        """The estimated memory held (what the cap is checked against)."""
        blocks = len(self._blocks)
        return blocks * ENTRY_BYTES + (self._holders - blocks) * HOLDER_BYTES

    def match(self, hashes: Sequence[int]) -> dict[PodKey, int]:
        """Per pod, how many leading blocks of `hashes` it holds without a gap."""
        matched: dict[PodKey, int] = {}
        holders: set[PodKey] | None = None
        for i, h in enumerate(hashes):
            entry = self._blocks.get(h)
            if entry is None:
                break
            self._blocks.move_to_end(h)
            holders = set(entry) if holders is None else holders & entry.keys()
            if not holders:
                break
            for pod in holders:
                matched[pod] = i + 1
        return matched

    def insert(self, hashes: Sequence[int], pod: PodKey, now: float) -> None:
        blocks = self._blocks
        added = 0
        for h in hashes:
            entry = blocks.get(h)
            if entry is None:
                blocks[h] = {pod: now}
                added += 1
            else:
                added += pod not in entry
                entry[pod] = now
                blocks.move_to_end(h)
        self._holders += added
        self.pods.add(pod)
        while blocks and self.size_bytes > self.max_bytes:
            self._holders -= len(blocks.popitem(last=False)[1])

    def forget_pods(self, live: set[PodKey]) -> None:
        """Drop pods that left the pool (a pod back at another address has a cold cache). A full scan,
        so only when a pod the table knows has left."""
        if self.pods <= live:
            return
        self.pods &= live
        for h in [h for h, entry in self._blocks.items() if not entry.keys() <= live]:
            entry = self._blocks[h]
            for pod in [p for p in entry if p not in live]:
                del entry[pod]
                self._holders -= 1
            if not entry:
                del self._blocks[h]


class PrefixCache:
    """The learned part, one per gateway (kept in RoutingState, so it survives reloads): a table per
    model, the lookup counts, and the post-choice hook that records where requests went — once
    prefix-cache has routed a model, whichever strategy routes its later requests, since the engine
    caches whatever it serves."""

    def __init__(self, settings: PrefixCacheSettings) -> None:
        self.settings = settings
        self.tables: dict[str, PrefixTable] = {}
        self.lookups: dict[str, list[int]] = {}  # model -> [matched, unmatched]
        self._last: tuple[Request | None, list[int]] = (None, [])

    def configure(self, settings: PrefixCacheSettings) -> None:
        self.settings = settings
        for table in self.tables.values():
            table.max_bytes = settings.table_bytes

    def table(self, model: str) -> PrefixTable:
        table = self.tables.get(model)
        if table is None:
            table = self.tables[model] = PrefixTable(self.settings.table_bytes)
        return table

    def forget(self, live: set[PodKey]) -> None:
        """The pool changed: forget pods not in `live` (their caches are gone with them; a pod that
        comes back, even at the same address, starts cold)."""
        for table in self.tables.values():
            table.forget_pods(live)

    def collect(self, views: Callable[[str], Sequence[PodView]], now: float) -> Iterator[Series]:
        yield Series("extproc_prefix_cache_lookups", "prefix-cache scorings: was a prefix of the prompt "
                     "found on some pod", "counter", ("model", "result"),
                     [((model, result), n) for model, (matched, unmatched) in self.lookups.items()
                      for result, n in (("matched", matched), ("unmatched", unmatched))])

    def hashes(self, request: Request) -> list[int]:
        """The request's block hashes, computed once for its scoring and its post-choice hook."""
        last, hashes = self._last
        if last is not request:
            hashes = block_hashes(request.prompt, self.settings.block_tokens, self.settings.max_blocks)
            self._last = (request, hashes)
        return hashes

    def count(self, model: str, matched: bool) -> None:
        counts = self.lookups.setdefault(model, [0, 0])
        counts[0 if matched else 1] += 1

    def post_choice(self, request: Request, chosen: PodView, now: float) -> None:
        # Only for models prefix-cache has scored (its table exists): other models' requests are not
        # hashed at all, so a gateway that never routes by prefix pays nothing per request.
        table = self.tables.get(request.model)
        if table is not None and (hashes := self.hashes(request)):
            table.insert(hashes, chosen.pod.key, now)


class PrefixCacheScorer:
    """Higher is better: the fraction of the prompt's blocks a pod holds as an unbroken prefix."""

    __slots__ = ("cache", "load_balance")
    lower_is_better = False

    def __init__(self, cache: PrefixCache, load_balance: LoadBalanceSettings) -> None:
        self.cache = cache
        self.load_balance = load_balance

    def score(self, request: Request, pods: Sequence[PodView], now: float) -> list[float]:
        hashes = self.cache.hashes(request)
        if not hashes:
            return [0.0] * len(pods)
        matched = self.cache.table(request.model).match(hashes)
        scores = [matched.get(p.pod.key, 0) / len(hashes) for p in pods]
        found = any(scores)
        self.cache.count(request.model, found)
        if found:
            busy = overloaded(pods, self.load_balance)
            scores = [0.0 if b else s for s, b in zip(scores, busy)]
        return scores


@register("prefix-cache", params=PARAMS)
def build(ctx: BuildContext) -> Profile:
    cache = ctx.store.slot("prefix-cache", lambda: PrefixCache(ctx.params))
    cache.configure(ctx.params)  # a reload may change the block size or the cap
    return Profile("prefix-cache", MaxScorePicker(ctx.rng),
                   scorers=[(PrefixCacheScorer(cache, ctx.settings.load_balance), 1.0)], hooks_of=[cache])

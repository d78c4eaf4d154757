"""Predicted output length per request, learned online the way AIBrix's SLO router keeps it.

Per model and per input-length bucket (round(log2(prompt tokens))), a histogram of completed output
lengths (also bucketed by round(log2)) over a sliding window: `window_s` seconds cut into slots of
`slot_s` seconds (AIBrix: 240 s rotated every 10 s). The prediction is the most frequent output bucket
of the request's input bucket (ties: the longer one, the cautious side), capped by `max_tokens`. With no
history yet the prediction is `max_tokens`, else `default_tokens`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

DEFAULT_WINDOW_S = 240.0
DEFAULT_SLOT_S = 10.0
DEFAULT_OUTPUT_TOKENS = 256


def bucket(tokens: float) -> int:
    """round(log2(tokens)); counts below 1 fall in bucket 0."""
    return round(math.log2(max(float(tokens), 1.0)))


@dataclass(slots=True)
class _Slot:
    epoch: int  # int(now // slot_s) when this slot was last written
    counts: Counter = field(default_factory=Counter)  # (input bucket, output bucket) -> completions


class OutputPredictor:
    """One model's predictor. `observe` is fed by the post-response hook, `predict` by the router."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, slot_s: float = DEFAULT_SLOT_S,
                 default_tokens: int = DEFAULT_OUTPUT_TOKENS) -> None:
        if slot_s <= 0 or window_s < slot_s:
            raise ValueError("the window must hold at least one slot")
        self.slot_s = slot_s
        self.slots = [_Slot(-1) for _ in range(max(1, round(window_s / slot_s)))]
        self.default_tokens = default_tokens

    def _slot(self, epoch: int) -> _Slot:
        slot = self.slots[epoch % len(self.slots)]
        if slot.epoch != epoch:  # rotated: this slot's data is older than the window
            slot.epoch = epoch
            slot.counts.clear()
        return slot

    def observe(self, prompt_tokens: int, output_tokens: int, now: float) -> None:
        if output_tokens <= 0:
            return
        self._slot(int(now // self.slot_s)).counts[(bucket(prompt_tokens), bucket(output_tokens))] += 1

    def histogram(self, prompt_tokens: int, now: float) -> dict[int, int]:
        """Output bucket -> completions within the window, for this prompt length's bucket."""
        epoch = int(now // self.slot_s)
        oldest = epoch - len(self.slots) + 1
        key = bucket(prompt_tokens)
        out: Counter = Counter()
        for slot in self.slots:
            if oldest <= slot.epoch <= epoch:
                for (i, o), n in slot.counts.items():
                    if i == key:
                        out[o] += n
        return dict(out)

    def predict(self, prompt_tokens: int, max_tokens: int | None, now: float) -> int:
        hist = self.histogram(prompt_tokens, now)
        if hist:
            top = max(hist.values())
            predicted = 2 ** max(b for b, n in hist.items() if n == top)
        else:
            predicted = max_tokens if max_tokens else self.default_tokens
        if max_tokens is not None and max_tokens > 0:
            predicted = min(predicted, max_tokens)
        return max(1, int(predicted))

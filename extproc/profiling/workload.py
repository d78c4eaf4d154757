"""What a benchmark cell sends: synthetic prompts of a given token length, request bodies, Poisson arrivals.

Pure: a seeded `random.Random` in, data out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from extproc.sim.protocol import CHARS_PER_TOKEN, CHAT_TOKENS_PER_MESSAGE

# Common three-letter words plus a space: 4 characters, which is one token by the simulator's estimate
# (CHARS_PER_TOKEN) and one token for BPE tokenizers of English (a space-prefixed common word).
WORDS = tuple(f"{w} " for w in (
    "the and for are but not you all any can had her was one our out day get has him his how man new now "
    "old see two way who boy did its let put say she too use dad mom cat dog sun sky sea red big top end"
).split())
assert all(len(w) == CHARS_PER_TOKEN for w in WORDS)


@dataclass(frozen=True, slots=True)
class Cell:
    """One benchmark point: prompts of `input_tokens`, answers of `output_tokens`, arrivals at `rate`/s."""

    input_tokens: int
    output_tokens: int
    rate: float

    def label(self) -> str:
        return f"in={self.input_tokens} out={self.output_tokens} rate={self.rate:g}"


def prompt_text(tokens: int, rng: random.Random) -> str:
    """`tokens` random words: distinct prompts, so prefix caching does not make a cell look faster."""
    return "".join(rng.choice(WORDS) for _ in range(max(1, tokens)))


def request_body(api: str, model: str, input_tokens: int, output_tokens: int, rng: random.Random,
                 exact_length: bool = True, temperature: float = 0.0) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": output_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if api == "chat":
        # The chat template adds tokens of its own per message; leave room so the prompt totals input_tokens.
        body["messages"] = [{"role": "user",
                             "content": prompt_text(input_tokens - CHAT_TOKENS_PER_MESSAGE, rng)}]
    else:
        body["prompt"] = prompt_text(input_tokens, rng)
    if exact_length:
        # vLLM and SGLang extensions: generate exactly max_tokens, no early stop at an EOS token.
        body["min_tokens"] = output_tokens
        body["ignore_eos"] = True
    return body


def arrival_times(count: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds from the cell's start: a Poisson process of `rate` given that `count` requests arrive in
    count / rate seconds (the first at 0, the others uniform over the span, sorted).

    AIBrix draws `count` exponential gaps instead, and their sum strays: 100 of them from seed 0 span 120 s
    at 1 req/s, an offered rate of 0.83. gen-profile's rule then finds no rate that "kept up" (TPUT at
    least 0.9 x the rate) however fast the GPU, and every cell falls to its lowest passing rate. Given
    the count, the cell offers the rate it is labelled with; the gaps are still exponential in the limit."""
    if count <= 0:
        return []
    span = count / rate
    return [0.0, *sorted(rng.uniform(0.0, span) for _ in range(count - 1))]


def doubling(start: int, limit: int) -> list[int]:
    values, v = [], start
    while v <= limit:
        values.append(v)
        v *= 2
    return values

"""`least-latency`: the pod predicted to answer this request soonest wins.

Per pod, exponentially weighted averages of the time to first token and the time per output token,
learned from every finished request (the post-response hook: the tally's tokens and Envoy's timings).
A request's prediction is TTFT + TPOT x its expected output (`max_tokens`, else 128). A pod with no
observation yet scores 0 while it is idle, so it is tried first: a new or recovered pod is explored, not
starved. Once it has a request in flight it scores the mean of the observed pods until its first answer
arrives: otherwise every request in that interval (seconds, at hundreds of requests/s) would herd onto it.
Streamed requests give both figures; a non-streamed one (its first byte is its last) only a time per
token that includes its prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.openai import Request
from extproc.pool.pod import PodKey
from extproc.routing.framework import BuildContext, PodView, Profile, register
from extproc.routing.load_math import LowestScorePicker, mean_fill
from extproc.vocabulary import RequestRecord

DEFAULT_OUTPUT_TOKENS = 128
WEIGHT = 0.2  # of each new observation in the averages: about the last ten requests count


class LatencyModel:
    """Learned per-pod latencies (kept in RoutingState: survives reloads)."""

    def __init__(self) -> None:
        self.ttft: dict[PodKey, float] = {}
        self.tpot: dict[PodKey, float] = {}

    @staticmethod
    def _blend(table: dict[PodKey, float], key: PodKey, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + WEIGHT * (value - old)

    def post_response(self, record: RequestRecord, now: float) -> None:
        out = record.output_tokens
        if not record.ok or record.ttfb_s is None or not out:
            return
        key = record.pod.key
        if record.stream:
            self._blend(self.ttft, key, record.ttfb_s)
            if out > 1:
                self._blend(self.tpot, key, max(0.0, record.e2e_s - record.ttfb_s) / (out - 1))
        else:
            self._blend(self.tpot, key, record.e2e_s / out)

    def predict(self, key: PodKey, output_tokens: int) -> float | None:
        ttft, tpot = self.ttft.get(key), self.tpot.get(key)
        if ttft is None and tpot is None:
            return None
        return (ttft or 0.0) + (tpot or 0.0) * output_tokens


class LeastLatencyScorer:
    lower_is_better = True

    def __init__(self, model: LatencyModel) -> None:
        self.model = model

    def score(self, request: Request, pods: Sequence[PodView], now: float) -> list[float]:
        out = request.max_tokens or DEFAULT_OUTPUT_TOKENS
        predictions = [self.model.predict(p.pod.key, out) for p in pods]
        # unobserved: explored first while idle, then an average pod
        filled = mean_fill(predictions, 0.0)
        return [0.0 if x is None and p.running == 0 else f for x, f, p in zip(predictions, filled, pods)]


@register("least-latency")
def build(ctx: BuildContext) -> Profile:
    model = ctx.store.slot("least-latency", LatencyModel)
    return Profile("least-latency", LowestScorePicker(ctx.rng),
                   scorers=[(LeastLatencyScorer(model), 1.0)], hooks_of=[model])

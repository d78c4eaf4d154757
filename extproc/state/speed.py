"""Each replica's speed as a function of its load: the capacity `load-balance` divides by.

Under continuous batching a replica's time per output token grows with the number of requests it
runs at once. Modelled as

    tpot(B) = base × (1 + shape × B)        B: requests in flight on the replica, itself included

`base` is the replica's own (its GPU, its co-tenants, its engine flags); `shape` (how much each extra
request slows every other one, relative to `base`) is a property of the model and the request mix more
than of the GPU, so it is pooled over the replicas of one GPU type, with the model-wide value as the
prior. A replica that got little traffic is then still valued at its speed: its `base` needs only a
few requests at any batch, and the slope it cannot see comes from its siblings.

Observations come from what the gateway already has for every streamed request: its time per output
token from the access-log timings ((e2e − ttfb) / (tokens − 1)), and the mean in-flight count on its pod
over its life (a `LoadIntegral` of the cross-gateway running count). Each record reaches one gateway;
gateways share the sums they fit from (`export` / `merge_peers`, through Redis or the workers'
segment), so every gateway fits on the fleet's records: one that has routed little, or just started,
routes on what the others measured. Without the sharing (Redis down) each fits on its own records.

Statistics are exponentially forgotten: `base` over a short horizon (`base_tau`, seconds: a replica
that slows is seen within a few refreshes), the slope over a long one (`shape_tau`: it needs spread
in B, which takes load variation to collect). Pure and clock-injected, like the rest of `state/`.

The saturated throughput (the capacity people read on a dashboard) is what a replica kept full with
the current mix produces: the fitted line at the batch it saturates at, which already carries the
prefills batched with the decodes it was fitted on. Seen only at small batches the line knows
nothing of the compute-bound steps a full replica runs, so it is floored by compute: every token,
prompt or output, costs at least the replica's prefill time per prompt token. Per output token,

    1 / saturated = max(tpot(batch) / batch, (1 + prompt/output) × prefill)

with `prefill` the slope of time to first token against prompt length, pooled over a GPU type (it
is the hardware's compute speed), and prompt/output the replica's recent mix (its siblings' when it
has served nothing lately). Without the floor a short-output mix seen at low load read up to 8x high.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from extproc.pool.pod import Pod, PodKey
from extproc.sharing.speed_sums import BASE_TAU, GROUP, SHAPE_TAU, SPEED_VALUES, PeerSums
from extproc.vocabulary import Speed

# Weight (tokens) of the model-wide shape when pooling a GPU type's: a type with less slope
# information than this (tokens x batch variance) leans on the model's.
SHAPE_PRIOR = 2_000.0
# A pod's own base needs this many recent tokens to beat its GPU type's mean.
MIN_BASE_TOKENS = 50.0
MAX_SHAPE = 1.0  # a request slowing each other one by more than its base: a fit gone wrong
# A pod's own slope counts once its batch has varied by this much (standard deviation, requests):
# a slope from a batch that stayed within a request or two is noise, and the type's or model's is used.
MIN_SPREAD = 2.0
MIN_PROMPT_SPREAD = 32.0  # likewise for prefill time against prompt length (tokens)
# How much a pod's own base is to be trusted (see `_posteriors`): the spread of bases among pods of one
# GPU type (log scale: 0.1 is ±10 %), and among GPU types of one model (a pod with no siblings).
TYPE_SPREAD = 0.10
MODEL_SPREAD = 0.50
# Per-token noise of a request's time per token (relative variance × tokens), before any is measured,
# and its weight in requests: a 4-token request's figure is ±50 %, a 400-token one's ±5 %.
NOISE_PRIOR = 1.0
NOISE_PRIOR_REQUESTS = 4.0
# A pod's speed can change while nothing measures it (a co-tenant arrives, a clock throttles): its own
# figure loses this much certainty (variance of the log base) per second since its last request.
# A minute unmeasured weighs it like its type's figure; ten minutes, a third as much.
DRIFT_PER_SECOND = TYPE_SPREAD * TYPE_SPREAD / 60.0



class _Sums:
    """Exponentially forgotten weighted sums for y = tpot against x = batch (n: observations)."""

    __slots__ = ("w", "x", "y", "xx", "xy", "yy", "n", "t")

    def __init__(self, now: float) -> None:
        self.w = self.x = self.y = self.xx = self.xy = self.yy = self.n = 0.0
        self.t = now

    def decay(self, now: float, tau: float) -> None:
        if now > self.t:
            f = math.exp(-(now - self.t) / tau)
            self.w *= f
            self.x *= f
            self.y *= f
            self.xx *= f
            self.xy *= f
            self.yy *= f
            self.n *= f
            self.t = now

    def vector(self) -> tuple[float, ...]:
        return self.t, self.w, self.x, self.y, self.xx, self.xy, self.yy, self.n

    def become(self, own: _Sums, row: Sequence[float], i: int, now: float, tau: float) -> _Sums:
        """These sums set to `own` forgotten to `now` plus another's already forgotten to `now`
        (`row[i:i + 7]`): what `copy` then `merge` make, in one step and no new object."""
        f = math.exp(-(now - own.t) / tau) if now > own.t else 1.0
        self.w, self.x, self.y = own.w * f + row[i], own.x * f + row[i + 1], own.y * f + row[i + 2]
        self.xx, self.xy, self.yy = own.xx * f + row[i + 3], own.xy * f + row[i + 4], own.yy * f + row[i + 5]
        self.n = own.n * f + row[i + 6]
        self.t = max(own.t, now)
        return self

    def copy(self) -> _Sums:
        out = _Sums.__new__(_Sums)
        out.w, out.x, out.y, out.xx, out.xy, out.yy, out.n, out.t = (
            self.w, self.x, self.y, self.xx, self.xy, self.yy, self.n, self.t)
        return out

    def merge(self, vector: Sequence[float], now: float, tau: float) -> None:
        """Add another gateway's sums (`vector`), both forgotten to `now` (decay is linear)."""
        self.decay(now, tau)
        t, *values = vector
        f = math.exp(-(now - t) / tau) if now > t else 1.0
        self.w += f * values[0]
        self.x += f * values[1]
        self.y += f * values[2]
        self.xx += f * values[3]
        self.xy += f * values[4]
        self.yy += f * values[5]
        self.n += f * values[6]

    def add(self, x: float, y: float, w: float) -> None:
        self.w += w
        self.x += w * x
        self.y += w * y
        self.xx += w * x * x
        self.xy += w * x * y
        self.yy += w * y * y
        self.n += 1.0

    def line(self, min_spread: float) -> tuple[float, float, float] | None:
        """Least squares y = a + b·x: (a, b, information w·var(x)); None without spread in x."""
        if self.w <= 0:
            return None
        mx = self.x / self.w
        var = self.xx / self.w - mx * mx
        if var < min_spread * min_spread:
            return None
        b = (self.xy / self.w - mx * self.y / self.w) / var
        return self.y / self.w - b * mx, b, self.w * var

    def slope(self) -> tuple[float, float] | None:
        """(relative slope b/a of the pod's own line, information w·var(x)); None without spread."""
        fit = self.line(MIN_SPREAD)
        if fit is None or fit[0] <= 0:
            return None
        a, b, info = fit
        return min(MAX_SHAPE, max(0.0, b / a)), info

    def base(self, shape: float, min_tokens: float = MIN_BASE_TOKENS) -> float | None:
        """Least-squares `base` of y = base × (1 + shape × x)."""
        den = self.w + 2 * shape * self.x + shape * shape * self.xx
        if self.w < min_tokens or self.w <= 0 or den <= 0:
            return None
        value = (self.y + shape * self.xy) / den
        return value if value > 0 else None

    def noise(self, base: float, shape: float) -> float:
        """Σ over observations of tokens × (relative residual)²: each request's time per token is a
        mean over its tokens, so its variance falls as 1/tokens and this sum estimates n × the
        per-token relative variance."""
        fitted_y = self.y + shape * self.xy                      # Σ w·y·(1 + k·x)
        fitted_sq = self.w + 2 * shape * self.x + shape * shape * self.xx  # Σ w·(1 + k·x)²
        return max(0.0, self.yy - 2 * base * fitted_y + base * base * fitted_sq) / (base * base)


@dataclass(slots=True)
class _Pod:
    recent: _Sums  # for base
    long: _Sums    # for shape
    kv: _Sums      # x: engine running count, y: KV usage (their ratio: KV per request)
    prefill: _Sums  # per streamed request: x = prompt tokens, y = time to first token (w = 1)
    mix: _Sums      # per request: x = output tokens, y = prompt tokens (their ratio: the mix)
    measured: float = 0.0  # when its last time per token was observed
    version: int = 0       # the estimator's count of records at its last one: what was merged or
                           # shared of it before a different number is stale

    def shared(self) -> tuple[_Sums, _Sums, _Sums, _Sums]:
        """The sums gateways share: each counts the records that gateway received. Not `kv`: every
        gateway scrapes every engine itself."""
        return self.recent, self.long, self.prefill, self.mix

    def prompt_per_output(self) -> float | None:
        m = self.mix
        return m.y / m.x if m.x > 0 else None

    def kv_per_request(self) -> float | None:
        kv = self.kv
        return kv.y / kv.x if kv.x > 0 and kv.y > 0 else None


class SpeedEstimator:
    def __init__(self, base_tau: float = BASE_TAU, shape_tau: float = SHAPE_TAU,
                 kv_tau: float = 60.0) -> None:
        if min(base_tau, shape_tau, kv_tau) <= 0:
            raise ValueError("time constants must be positive")
        self.base_tau, self.shape_tau, self.kv_tau = base_tau, shape_tau, kv_tau
        self._pods: dict[PodKey, _Pod] = {}
        self._speeds: dict[PodKey, Speed] = {}
        self._peers: dict[PodKey, list[list[float]]] = {}  # other gateways' `export`s
        # ... or, read through Redis, their sums in one array (merge_peer_sums): the read, the shift to
        # this estimator's clock, a number per read (what a kept merge was made of) and the pods whose
        # rows stand aside (restarted since the read)
        self._peer_sums: PeerSums | None = None
        self._peer_shift = 0.0
        self._peer_read = 0
        self._peer_aside: set[PodKey] = set()
        # pod -> (its own version, the peers' list or read, the two merged): reused while neither moved,
        # since forgetting is multiplicative (a merge decayed later is the merge of the decayed sums)
        self._merged: dict[PodKey, tuple[int, list[list[float]] | int, _Pod]] = {}
        self._records = 0  # records observed, ever: versions are unique across pods and their restarts

    def _pod(self, key: PodKey, now: float) -> _Pod:
        pod = self._pods.get(key)
        if pod is None:
            pod = self._pods[key] = _Pod(_Sums(now), _Sums(now), _Sums(now), _Sums(now), _Sums(now))
        return pod

    def observe(self, key: PodKey, tpot: float, batch: float, tokens: float, now: float) -> None:
        """One finished request: its seconds per output token, the mean in-flight count on its pod
        over its life (itself included), and its output tokens (the observation's weight)."""
        if not (tpot > 0 and batch > 0 and tokens > 0) or not math.isfinite(tpot + batch):
            return
        pod = self._pod(key, now)
        pod.measured = max(pod.measured, now)
        self._records += 1
        pod.version = self._records
        for sums, tau in ((pod.recent, self.base_tau), (pod.long, self.shape_tau)):
            sums.decay(now, tau)
            sums.add(batch, tpot, tokens)

    def observe_prefill(self, key: PodKey, ttft: float | None, prompt: float, output: float,
                        now: float) -> None:
        """A finished request's prompt and output tokens (the mix) and, when streamed, its time to
        first token (prefill speed): for the saturated figure."""
        if not (prompt > 0 and output > 0):
            return
        pod = self._pod(key, now)
        self._records += 1
        pod.version = self._records
        pod.mix.decay(now, self.shape_tau)
        pod.mix.add(output, prompt, 1.0)
        if ttft is not None and ttft >= 0 and math.isfinite(ttft):
            pod.prefill.decay(now, self.shape_tau)
            pod.prefill.add(prompt, ttft, 1.0)

    def observe_kv(self, key: PodKey, engine_running: float | None, kv_usage: float | None,
                   now: float) -> None:
        """An engine sample: KV usage per running request sets the batch the KV cache allows. A ratio
        of forgotten sums, not a mean of ratios: at a batch of one or two, which request happens to
        run would swing a per-sample ratio."""
        if not engine_running or engine_running < 1 or kv_usage is None or not 0.0 <= kv_usage <= 1.0:
            return
        pod = self._pod(key, now)
        pod.kv.decay(now, self.kv_tau)
        pod.kv.add(engine_running, kv_usage, 1.0)

    def refresh(self, pods: Iterable[Pod], now: float, max_batch: float = 256.0) -> None:
        """Refit every pod: the shapes per GPU type and model, then each pod's base."""
        pods = list(pods)
        states = self._evidence(pods, now)
        slopes: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for p in pods:
            state = states.get(p.key)
            if state is None:
                continue
            state.recent.decay(now, self.base_tau)
            state.long.decay(now, self.shape_tau)
            fit = state.long.slope()
            if fit is not None:
                slopes.setdefault((p.model, p.gpu), []).append(fit)
        model_shape = {}
        for (model, _), fits in slopes.items():
            acc = model_shape.setdefault(model, [0.0, 0.0])
            for k, info in fits:
                acc[0] += k * info
                acc[1] += info
        shapes: dict[tuple[str, str], float] = {}
        for p in pods:
            group = (p.model, p.gpu)
            if group in shapes:
                continue
            prior_k, prior_info = model_shape.get(p.model, (0.0, 0.0))
            prior = prior_k / prior_info if prior_info > 0 else 0.0
            num, den = prior * SHAPE_PRIOR, SHAPE_PRIOR
            for k, info in slopes.get(group, ()):
                num += k * info
                den += info
            shapes[group] = num / den
        own: dict[PodKey, _Own] = {}
        for p in pods:
            state = states.get(p.key)
            if state is not None:
                shape = shapes[(p.model, p.gpu)]
                sums = state.recent if state.recent.w >= MIN_BASE_TOKENS else state.long
                b = sums.base(shape, min_tokens=0.0)  # quiet lately: its older record, not a stranger's
                if b is not None:
                    own[p.key] = _Own(p, math.log(b), sums.noise(b, shape), sums.w, sums.n,
                                      max(0.0, now - state.measured))
        posteriors = _posteriors(pods, own)
        prefill, mixes = self._pooled(pods, states, now)
        self._speeds = {}
        for p in pods:
            posterior = posteriors.get(p.key)
            if posterior is None:
                continue
            base, spread = posterior
            shape = shapes[(p.model, p.gpu)]
            # Past the batches a type was seen at the curve only steepens (steps turn compute-bound),
            # so the saturated figure extrapolates with the steepest slope seen on the model.
            prior_k, prior_info = model_shape.get(p.model, (0.0, 0.0))
            steep = max(shape, prior_k / prior_info if prior_info > 0 else 0.0)
            batch = max_batch
            state = states.get(p.key)
            kv = state.kv_per_request() if state is not None else None
            if kv:
                batch = max(1.0, min(batch, 1.0 / kv))
            per_prompt = prefill.get((p.model, p.gpu), 0.0)
            mix = state.prompt_per_output() if state is not None else None
            if mix is None:  # served nothing lately: valued on the mix its siblings see
                mix = mixes.get(p.model, 0.0)
            per_token = max(base * (1.0 + steep * batch) / batch, (1.0 + mix) * per_prompt)
            self._speeds[p.key] = Speed(base, shape, 1.0 / per_token, batch, spread)

    def _pooled(self, pods: list[Pod], states: Mapping[PodKey, _Pod],
                now: float) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
        """Seconds of prefill per prompt token per (model, GPU type), and prompt tokens per output
        token per model. Prefill: the slope of time to first token against prompt length, pooled
        over the type's pods by information; where no pod has spread in its prompts, the type's mean
        time to first token per prompt token (an upper bound: it also holds each step's fixed cost)."""
        prefill: dict[tuple[str, str], list[float]] = {}  # Σb·info, Σinfo, Σttft, Σprompt
        mix: dict[str, list[float]] = {}  # Σprompt, Σoutput
        for p in pods:
            state = states.get(p.key)
            if state is None:
                continue
            state.prefill.decay(now, self.shape_tau)
            state.mix.decay(now, self.shape_tau)
            acc = prefill.setdefault((p.model, p.gpu), [0.0, 0.0, 0.0, 0.0])
            fit = state.prefill.line(MIN_PROMPT_SPREAD)
            if fit is not None and fit[1] > 0:
                acc[0] += fit[1] * fit[2]
                acc[1] += fit[2]
            acc[2] += state.prefill.y
            acc[3] += state.prefill.x
            m = mix.setdefault(p.model, [0.0, 0.0])
            m[0] += state.mix.y
            m[1] += state.mix.x
        per_prompt = {g: a[0] / a[1] if a[1] > 0 else a[2] / a[3] if a[3] > 0 else 0.0
                      for g, a in prefill.items()}
        return per_prompt, {model: y / x for model, (y, x) in mix.items() if x > 0}

    def speed(self, key: PodKey) -> Speed | None:
        return self._speeds.get(key)

    def speeds(self) -> Mapping[PodKey, Speed]:
        return self._speeds

    # -- what other gateways measured ----------------------------------------------------------------

    def version(self, key: PodKey) -> int:
        """Changes whenever the pod's shared evidence does (0: none): `export` again only then."""
        pod = self._pods.get(key)
        return pod.version if pod is not None else 0

    def export(self, key: PodKey) -> list[float] | None:
        """This gateway's own evidence on a pod, for the others (`merge_peers`): every record reaches
        one gateway, so the gateways' sums add up to the fleet's."""
        pod = self._pods.get(key)
        if pod is None:
            return None
        return [pod.measured, *(v for sums in pod.shared() for v in sums.vector())]

    def merge_peers(self, key: PodKey, vectors: Iterable[list[float]]) -> None:
        """Other gateways' evidence on a pod (their `export`), replacing what they said before;
        nothing when they are not heard from (Redis down): this gateway fits on its own records."""
        peers = [v for v in vectors if len(v) == SPEED_VALUES and all(map(math.isfinite, v))]
        if peers:
            self._peers[key] = peers
        else:
            self._peers.pop(key, None)

    def merge_peer_sums(self, sums: PeerSums | None, shift: float = 0.0) -> None:
        """The other gateways' evidence summed per pod, one row each (RedisState's read, whose times
        are moved by `shift` to this estimator's clock), replacing the last; None: not read that way
        (merge_peers per pod, or none)."""
        self._peer_sums, self._peer_shift = sums, shift
        self._peer_read += 1
        self._peer_aside = set()

    def _evidence(self, pods: list[Pod], now: float) -> dict[PodKey, _Pod]:
        """Each pod's sums: its own, plus the other gateways' decayed to now."""
        if self._peer_sums is not None:
            return self._evidence_summed(pods, now, self._peer_sums)
        out: dict[PodKey, _Pod] = {}
        taus = (self.base_tau, self.shape_tau, self.shape_tau, self.shape_tau)
        for p in pods:
            own = self._pods.get(p.key)
            peers = self._peers.get(p.key)
            if not peers:
                if own is not None:
                    out[p.key] = own
                continue
            version = own.version if own is not None else -1
            cached = self._merged.get(p.key)
            if cached is not None and cached[0] == version and cached[1] is peers:
                out[p.key] = cached[2]  # refresh decays it to now, as it would a new merge
                continue
            if own is not None:  # its own sums copied as they are (what `export` would say, unparsed)
                merged = _Pod(own.recent.copy(), own.long.copy(), own.kv, own.prefill.copy(),
                              own.mix.copy(), own.measured)
            else:
                merged = _Pod(_Sums(now), _Sums(now), _Sums(now), _Sums(now), _Sums(now))
            groups = tuple(zip(merged.shared(), taus))
            for source in peers:
                merged.measured = max(merged.measured, source[0])
                for i, (sums, tau) in enumerate(groups):
                    sums.merge(source[1 + i * GROUP:1 + (i + 1) * GROUP], now, tau)
            out[p.key] = merged
            self._merged[p.key] = (version, peers, merged)
        return out

    def _evidence_summed(self, pods: list[Pod], now: float, sums: PeerSums) -> dict[PodKey, _Pod]:
        """`_evidence` with the others' sums as one array: the pods whose merge moved (a new read, or
        records of their own since) have their rows forgotten to now together, then are merged."""
        import numpy as np

        out: dict[PodKey, _Pod] = {}
        rows, merged, read, aside = sums.rows, self._merged, self._peer_read, self._peer_aside
        todo: list[tuple[PodKey, _Pod | None, int, _Pod | None]] = []
        at: list[int] = []
        for p in pods:
            key = p.key
            own = self._pods.get(key)
            row = rows.get(key)
            if row is None or key in aside:
                if own is not None:
                    out[key] = own
                continue
            version = own.version if own is not None else -1
            cached = merged.get(key)
            if cached is not None and cached[0] == version and cached[1] == read:
                out[key] = cached[2]  # refresh decays it to now, as it would a new merge
                continue
            # a merge of an earlier read is set anew in place (allocating it was a third of the work)
            reuse = cached[2] if cached is not None and type(cached[1]) is int else None
            todo.append((key, own, version, reuse))
            at.append(row)
        if not todo:
            return out
        m = sums.matrix[at]
        taus = (self.base_tau, self.shape_tau, self.shape_tau, self.shape_tau)
        decayed = np.empty_like(m)
        decayed[:, 0] = m[:, 0] + self._peer_shift
        with np.errstate(all="ignore"):
            for g, tau in enumerate(taus):
                i = 1 + g * GROUP
                age = now - (m[:, i] + self._peer_shift)
                f = np.where(age > 0, np.exp(-age / tau), 1.0)[:, None]
                decayed[:, i] = now
                decayed[:, i + 1:i + GROUP] = f * m[:, i + 1:i + GROUP]
        base, shape = taus[:2]
        for (key, own, version, pod), row in zip(todo, decayed.tolist()):
            if own is None:
                blank = _Sums(now)
                own = _Pod(blank, blank, _Sums(now), blank, blank)
            if pod is None:
                pod = _Pod(*(_Sums.__new__(_Sums) for _ in range(5)))
            pod.recent.become(own.recent, row, 2, now, base)
            pod.long.become(own.long, row, 10, now, shape)
            pod.prefill.become(own.prefill, row, 18, now, shape)
            pod.mix.become(own.mix, row, 26, now, shape)
            pod.kv, pod.measured = own.kv, max(own.measured, row[0])
            out[key] = pod
            merged[key] = (version, read, pod)
        return out

    def restarted(self, key: PodKey) -> None:
        """The pod answers again after being out of routing: likely a new engine process, so what was
        measured before says little. Its own figures go; until re-measured it competes at its type's
        (and ties with its siblings, so it is re-measured at once)."""
        self._pods.pop(key, None)
        self._speeds.pop(key, None)
        self._peers.pop(key, None)  # theirs too, until they re-measure it and say so
        self._peer_aside.add(key)
        self._merged.pop(key, None)

    def forget(self, live: Iterable[PodKey]) -> None:
        live = set(live)
        for table in (self._pods, self._speeds, self._peers, self._merged):
            for key in [k for k in table if k not in live]:
                del table[key]


@dataclass(slots=True, frozen=True)
class _Own:
    """A pod's own fit: log base, its noise sum (`_Sums.noise`), tokens and requests behind it."""

    pod: Pod
    log_base: float
    noise: float
    tokens: float
    requests: float
    age: float  # seconds since its last request was measured


def _posteriors(pods: list[Pod], own: Mapping[PodKey, _Own]) -> dict[PodKey, tuple[float, float]]:
    """(base, spread) per pod: its own fit weighed against its GPU type's, by the evidence behind each.

    A pod's own base from a few short requests is noise beside its siblings' many; one from many
    requests stands on its own (a noisy neighbour, a throttled GPU stays seen as slower). On a log
    scale: the pod's own estimate has variance (per-token noise of its type) / (its tokens); its prior
    is the precision-weighted mean of its siblings' (the other pods of its type, each widened by
    TYPE_SPREAD), else of the model's other types (MODEL_SPREAD). The posterior is their precision-
    weighted mean. While nothing measures a pod its own figure loses certainty (DRIFT_PER_SECOND):
    its estimate drifts back to its type's and its spread widens, until its scores tie with the best
    and a request re-measures it.
    """
    noise: dict[tuple[str, str], list[float]] = {}
    for o in own.values():
        acc = noise.setdefault((o.pod.model, o.pod.gpu), [NOISE_PRIOR * NOISE_PRIOR_REQUESTS,
                                                           NOISE_PRIOR_REQUESTS])
        acc[0] += o.noise
        acc[1] += o.requests
    variance = {}  # of each pod's own log base
    for k, o in own.items():
        total, requests = noise[(o.pod.model, o.pod.gpu)]
        variance[k] = total / requests / o.tokens + DRIFT_PER_SECOND * o.age
    groups: dict[tuple[str, str], list[float]] = {}  # Σ precision × log base, Σ precision
    for k, o in own.items():
        for group, spread in (((o.pod.model, o.pod.gpu), TYPE_SPREAD), ((o.pod.model, ""), MODEL_SPREAD)):
            precision = 1.0 / (variance[k] + spread * spread)
            acc = groups.setdefault(group, [0.0, 0.0])
            acc[0] += precision * o.log_base
            acc[1] += precision
    out: dict[PodKey, tuple[float, float]] = {}
    for p in pods:
        o = own.get(p.key)
        prior = _prior(p, o, variance.get(p.key, 0.0), groups)
        if o is None and prior is None:
            continue
        mean = precision = 0.0
        if o is not None:  # its variance is > 0: the noise sums start at the prior's
            mean, precision = o.log_base / variance[p.key], 1.0 / variance[p.key]
        if prior is not None:
            mean += prior[0] / prior[1]
            precision += 1.0 / prior[1]
        out[p.key] = (math.exp(mean / precision), math.sqrt(1.0 / precision))
    return out


def _prior(pod: Pod, own: _Own | None, variance: float,
           groups: Mapping[tuple[str, str], list[float]]) -> tuple[float, float] | None:
    """(log base, variance) the pod's siblings say it has: its type's other pods, else the model's
    other types'; None when no other pod has a fit."""
    for group, spread in (((pod.model, pod.gpu), TYPE_SPREAD), ((pod.model, ""), MODEL_SPREAD)):
        acc = groups.get(group)
        if acc is None:
            continue
        total, precision = acc
        if own is not None:  # leave the pod itself out
            mine = 1.0 / (variance + spread * spread)
            total, precision = total - mine * own.log_base, precision - mine
        if precision > 1e-9:
            return total / precision, 1.0 / precision + spread * spread
    return None


class LoadIntegral:
    """∫ running dt per pod, advanced whenever the count changes or is sampled: the mean in-flight
    count over any interval is the difference of two readings over its length."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state: dict[PodKey, list[float]] = {}  # [time, running since then, integral]

    def advance(self, key: PodKey, now: float, running: float) -> float:
        """The integral up to `now`; from now on the count is `running`."""
        s = self._state.get(key)
        if s is None:
            self._state[key] = [now, running, 0.0]
            return 0.0
        if now > s[0]:
            s[2] += s[1] * (now - s[0])
            s[0] = now
        s[1] = running
        return s[2]

    def forget(self, live: Iterable[PodKey]) -> None:
        live = set(live)
        for key in [k for k in self._state if k not in live]:
            del self._state[key]

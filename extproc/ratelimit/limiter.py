"""The limiter the ext_proc stream consults once per request, before routing: whose budget, which
limits, admitted or a 429; and the output tokens charged when the access log reports them.

Budgets are per subject and model. The subject is the API key's SHA-256 (never the key) or the body's
`user` (AIBrix's way); a request without one shares the "anonymous" budget. Metric labels are the
model (a configured one: unknown models are refused before this) and the key class, never a subject.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import sha256

from prometheus_client import CollectorRegistry, Counter, Histogram

from extproc.openai import OpenAIError, Request
from extproc.ratelimit import bucket
from extproc.ratelimit.bucket import Verdict
from extproc.ratelimit.local_store import LocalStore
from extproc.ratelimit.redis_store import LATE, UNAVAILABLE, RedisStore
from extproc.ratelimit.settings import Limits, RateLimitSettings
from extproc.ratelimit.top import TopBudgets
from extproc.ratelimit.worker_store import WorkerBudgets

ANONYMOUS = "anonymous"
MAX_USER_BYTES = 256  # a `user` is a Redis key and a map key: longer ones are refused
AIBRIX_USER = "aibrix_user"  # key class of a budget whose limits came from AIBrix's user record


@dataclass(slots=True, frozen=True)
class Budget:
    """The budget a request draws on, before admission."""
    bucket_id: str             # "<model>:<subject>"
    limits: Limits             # from the config (AIBrix's record, read in Redis, may replace them)
    key_class: str             # default | override: the metric label
    aibrix_user: str | None    # whose AIBrix record to read


@dataclass(slots=True, frozen=True)
class Admission:
    """An admitted request's budget: what its response headers say and where its output is charged."""
    bucket_id: str
    limits: Limits
    verdict: Verdict

    def headers(self) -> list[tuple[str, str]]:
        return bucket.headers(self.limits, self.verdict)


class RateLimited(OpenAIError):
    """429, OpenAI's shape: code rate_limit_exceeded, type the limit (requests | tokens)."""

    def __init__(self, message: str, limit: str, retry_after_s: float,
                 headers: list[tuple[str, str]]) -> None:
        # Retry-After in whole seconds (at least 1); retry-after-ms, which OpenAI's clients read first
        super().__init__(429, message, type=limit, code="rate_limit_exceeded", headers=(
            *headers, ("retry-after", str(max(1, math.ceil(retry_after_s)))),
            ("retry-after-ms", str(max(1, math.ceil(retry_after_s * 1000))))))


class RateLimiter:
    def __init__(self, settings: RateLimitSettings, registry: CollectorRegistry | None = None,
                 store: RedisStore | None = None, clock: Callable[[], float] = time.monotonic,
                 local: LocalStore | WorkerBudgets | None = None) -> None:
        self.settings = settings
        self._redis = store
        # without Redis: this process's budgets, or those `serve --workers N` shares in memory
        self._local = local if local is not None else LocalStore()
        self._clock = clock
        self.top = TopBudgets(clock)
        self.limited = Counter("extproc_rate_limited_requests", "Requests refused by a rate limit (429), "
                               "by model, limit (requests | tokens) and key class (default | override | "
                               "aibrix_user)", ["model", "limit", "key_class"], registry=registry)
        self.unchecked = Counter("extproc_rate_limit_unchecked_requests", "Requests admitted without a "
                                 "limit check (limits fail open), by reason: late (Redis did not answer "
                                 "within rate_limits.redis_timeout_ms) or unavailable (Redis failed)",
                                 ["reason"], registry=registry)
        for reason in (LATE, UNAVAILABLE):  # both series from the start: a dashboard's rate sees 0
            self.unchecked.labels(reason)
        self.check_seconds = Histogram(
            "extproc_rate_limit_check_seconds", "Time a request waited for its budget from Redis "
            "(rate_limits.redis_timeout_ms bounds it)", registry=registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1))
        if registry is not None:
            registry.register(self.top)

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def apply(self, settings: RateLimitSettings) -> None:
        """A reload: new limits apply to the budgets as they stand (nothing is reset)."""
        self.settings = settings
        if self._redis is not None:
            self._redis.timeout = settings.redis_timeout_s

    def budget(self, authorization: str | None, request: Request) -> Budget | None:
        """Which budget and limits apply to the request (None: none does). Synchronous and cheap:
        the key is hashed only when a limit applies or its override could."""
        s = self.settings
        if not s.by_subject:
            limits, key_class = s.limits_for("", request.model)
            if not limits.any:
                return None
            subject = self._subject(authorization, request)
        else:
            subject = self._subject(authorization, request)
            limits, key_class = s.limits_for(subject, request.model)
            if not limits.any and not (s.aibrix_users and self._redis is not None):
                return None
        aibrix = s.aibrix_users and subject.startswith("user:")
        return Budget(f"{request.model}:{subject}", limits, key_class, subject[5:] if aibrix else None)

    def _subject(self, authorization: str | None, request: Request) -> str:
        if self.settings.key_by == "api_key":
            scheme, _, token = authorization.strip().partition(" ") if authorization else ("", "", "")
            token = token.strip()
            if not token or scheme.lower() != "bearer":
                return ANONYMOUS
            return "key:" + sha256(token.encode()).hexdigest()
        user = request.user
        if not user:
            return ANONYMOUS
        if len(user.encode()) > MAX_USER_BYTES:
            raise OpenAIError(400, f"user is longer than {MAX_USER_BYTES} bytes", param="user",
                              code="invalid_user")
        return "user:" + user

    @property
    def shared(self) -> bool:
        """Budgets live in Redis: admission awaits one round trip (`admit_shared`)."""
        return self._redis is not None

    def admit_here(self, budget: Budget, request: Request) -> Admission:
        """Admission against this process's budgets; raises RateLimited."""
        verdict = self._local.take(budget.bucket_id, budget.limits, request.prompt_tokens, self._clock())
        return self._judged(budget, budget.limits, budget.key_class, verdict, request.model)

    async def admit_shared(self, budget: Budget, request: Request) -> Admission | None:
        """Admission against the budgets in Redis; None: Redis did not answer in time (admitted
        unchecked) or the AIBrix record left nothing limited. Raises RateLimited."""
        started = self._clock()
        answer = await self._redis.take(budget.bucket_id, budget.limits,  # type: ignore[union-attr]
                                        request.prompt_tokens, budget.aibrix_user)
        self.check_seconds.observe(self._clock() - started)
        if isinstance(answer, str):
            self.unchecked.labels(answer).inc()
            return None
        judged, verdict = answer
        if not judged.any:
            return None
        key_class = budget.key_class if judged == budget.limits else AIBRIX_USER
        return self._judged(budget, judged, key_class, verdict, request.model)

    def _judged(self, budget: Budget, limits: Limits, key_class: str, verdict: Verdict,
                model: str) -> Admission:
        admission = Admission(budget.bucket_id, limits, verdict)
        self.top.saw(model, budget.bucket_id, limits, verdict)
        if not verdict.admitted:
            self.limited.labels(model, verdict.exceeded, key_class).inc()
            raise self._refusal(model, limits, verdict, admission.headers())
        return admission

    def charge(self, bucket_id: str, tokens_limit: int, tokens: int | None) -> None:
        """The output tokens the access log counted for an admitted request, owed by its budget."""
        if not tokens or tokens <= 0 or tokens_limit <= 0:
            return
        if self._redis is None:
            self._local.charge(bucket_id, tokens_limit, tokens, self._clock())
        else:
            self._redis.charge(bucket_id, tokens_limit, tokens)

    @staticmethod
    def _refusal(model: str, limits: Limits, v: Verdict, headers: list[tuple[str, str]]) -> RateLimited:
        wait = bucket.retry_after(limits, v)
        if v.exceeded == "requests":
            message = (f"Rate limit reached for model {model!r} on requests per minute: limit "
                       f"{limits.requests}. Please try again in {bucket.duration(wait)}.")
        elif limits.tokens is not None and v.cost > limits.tokens:
            message = (f"Request too large for model {model!r}: about {v.cost} prompt tokens, above the "
                       f"limit of {limits.tokens} tokens per minute.")
        else:
            message = (f"Rate limit reached for model {model!r} on tokens per minute: limit "
                       f"{limits.tokens}, about {v.cost} requested. "
                       f"Please try again in {bucket.duration(wait)}.")
        return RateLimited(message, v.exceeded or "requests", wait, headers)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.close()

"""Budgets shared by every gateway through Redis: one script call per request, bounded in time.

The script (the token bucket of bucket.py, on Redis's clock so gateways' clocks need not agree) reads
AIBrix's user record first when asked, takes or charges atomically and returns what is left. The calls
made while the event loop runs one batch of callbacks go out together, one pipeline on one connection:
one round trip per request at most, and no connection per concurrent request under a burst.
A request waits at most `timeout` for its answer, then is admitted unchecked (fail open: losing Redis
never fails requests, it lifts the limits); a late answer is let arrive (cancelling would cost the
connection) and the budget still pays. After an error (Redis gone) Redis is left alone for BACKOFF_S,
so an outage costs requests nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable

from extproc import redis_connect
from extproc.ratelimit.bucket import WINDOW_S, Verdict
from extproc.ratelimit.settings import Limits
from extproc.redis_connect import RedisTarget

log = logging.getLogger(__name__)

BACKOFF_S = 1.0
CALL_TIMEOUT_S = 1.0  # a pipeline's bound (requests stop waiting long before; charges wait on nothing)
KEY_PREFIX = "extproc:ratelimit:"
# Why a request went unchecked (the metric's `reason`)
LATE, UNAVAILABLE = "late", "unavailable"
AIBRIX_USER_PREFIX = "aibrix-users/"  # AIBrix's user records: {"name": ..., "rpm": N, "tpm": N}

# KEYS[1]: the bucket (a hash r, t, ts and the rates it holds, rl, tl); KEYS[2]: AIBrix's user record,
# absent (the config's limits). ARGV: mode (take | charge), requests/min, tokens/min (0: unlimited),
# tokens to take or charge, window ms. A charge refills every dimension the bucket holds at the rates of
# its last admission (its requests rate is not sent), and the key lives until its slowest dimension is
# full again: expiring sooner would hand back a full budget.
# Returns {admitted 0/1, exceeded ("" | requests | tokens), requests left, tokens left, rpm, tpm}.
SCRIPT = """
local rl, tl = tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, win = tonumber(ARGV[4]), tonumber(ARGV[5])
if KEYS[2] then
  local rec = redis.call('GET', KEYS[2])
  if rec then
    local ok, user = pcall(cjson.decode, rec)
    if ok and type(user) == 'table' then
      local rpm, tpm = tonumber(user.rpm), tonumber(user.tpm)
      if rpm and rpm > 0 then rl = rpm end
      if tpm and tpm > 0 then tl = tpm end
    end
  end
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local h = redis.call('HMGET', KEYS[1], 'r', 't', 'ts', 'rl', 'tl')
local hrl, htl = tonumber(h[4]), tonumber(h[5])
if ARGV[1] == 'charge' then
  rl = hrl or 0
  if tl == 0 then tl = htl or 0 end
end
local r, t, ts = tonumber(h[1]), tonumber(h[2]), tonumber(h[3]) or now
if r == nil or hrl == 0 then r = rl end
if t == nil or htl == 0 then t = tl end
local dt = math.max(0, now - ts)
if rl > 0 then r = math.min(rl, r + dt * rl / win) end
if tl > 0 then t = math.min(tl, t + dt * tl / win) end
local admitted, exceeded = 1, ''
if ARGV[1] == 'take' then
  if rl > 0 and r < 1 then admitted, exceeded = 0, 'requests'
  elseif tl > 0 and t < cost then admitted, exceeded = 0, 'tokens' end
  if admitted == 1 then
    if rl > 0 then r = r - 1 end
    if tl > 0 then t = t - cost end
  end
elseif tl > 0 then
  t = t - cost
end
local full = 0
if rl > 0 then full = math.max(full, (rl - r) * win / rl) end
if tl > 0 then full = math.max(full, (tl - t) * win / tl) end
redis.call('HSET', KEYS[1], 'r', tostring(r), 't', tostring(t), 'ts', now, 'rl', rl, 'tl', tl)
redis.call('PEXPIRE', KEYS[1], math.ceil(full) + 1000)
return {admitted, exceeded, tostring(r), tostring(t), rl, tl}
"""
SCRIPT_SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()  # noqa: S324 (Redis names scripts by SHA-1)


class RedisStore:
    def __init__(self, url: str | RedisTarget, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # the client loads only when Redis is used (redis_connect imports it on call)
        self._client = redis_connect.open_async(url, timeout=CALL_TIMEOUT_S)
        # On a Redis Cluster AIBrix's user records lie on other shards than the buckets, and a script
        # reads keys of one shard: the config's limits apply (docs/kubernetes.md).
        self._users = not (isinstance(url, RedisTarget) and url.cluster)
        self.timeout = timeout
        self._clock = clock
        self._resume_at = 0.0  # after a failure, Redis is skipped until then
        self._queue: list[tuple[tuple, asyncio.Future]] = []  # calls for the next pipeline
        self._sending: set[asyncio.Task] = set()
        self.failures = 0

    @staticmethod
    def key(bucket_id: str) -> str:
        return KEY_PREFIX + bucket_id

    async def take(self, bucket_id: str, limits: Limits, cost: int,
                   aibrix_user: str | None) -> tuple[Limits, Verdict] | str:
        """The verdict and the limits it was judged by (AIBrix's record may set them); or why there
        is none and the request goes unlimited: LATE (no answer within `timeout`) or UNAVAILABLE
        (Redis failed, now or less than BACKOFF_S ago)."""
        if self._clock() < self._resume_at:
            return UNAVAILABLE
        user_key = AIBRIX_USER_PREFIX + aibrix_user if aibrix_user and self._users else ""
        answer = self._call(self.key(bucket_id), user_key, "take", limits.requests or 0,
                            limits.tokens or 0, cost)
        done, _ = await asyncio.wait((answer,), timeout=self.timeout)
        if not done:
            return LATE
        if answer.exception() is not None:
            return UNAVAILABLE
        admitted, exceeded, requests, tokens, rpm, tpm = answer.result()
        exceeded = exceeded.decode() if isinstance(exceeded, bytes) else exceeded
        judged = Limits(int(rpm) or None, int(tpm) or None)
        return judged, Verdict(bool(admitted), exceeded or None, float(requests), float(tokens), cost)

    def charge(self, bucket_id: str, tokens_limit: int, tokens: int) -> None:
        """Owe `tokens` (counted output), in the background (the script refills the bucket's other
        dimensions at the rates it holds)."""
        if tokens_limit > 0 and tokens > 0 and self._clock() >= self._resume_at:
            self._call(self.key(bucket_id), "", "charge", 0, tokens_limit, tokens)

    def _call(self, *args: object) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        answer.add_done_callback(_retrieved)
        self._queue.append(((*args, int(WINDOW_S * 1000)), answer))
        if len(self._queue) == 1:  # the first of a batch: send once the loop's current callbacks ran
            loop.call_soon(self._flush)
        return answer

    def _flush(self) -> None:
        batch, self._queue = self._queue, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        from redis.exceptions import NoScriptError

        try:
            replies = await asyncio.wait_for(self._pipeline([args for args, _ in batch]), CALL_TIMEOUT_S)
            if any(isinstance(r, NoScriptError) for r in replies):  # Redis restarted: load it, once more
                await self._client.script_load(SCRIPT)
                replies = await asyncio.wait_for(self._pipeline([a for a, _ in batch]), CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 (connection errors, timeouts: all fail open)
            self._failed(exc)
            replies = [exc] * len(batch)
        for (_, answer), reply in zip(batch, replies, strict=True):
            if not answer.done():
                if isinstance(reply, Exception):
                    answer.set_exception(reply)
                else:
                    answer.set_result(reply)

    async def _pipeline(self, calls: list[tuple]) -> list:
        """The replies (an error in place of a failed call's, as a pipeline gives them)."""
        if len(calls) == 1:  # a pipeline alone costs ~20 µs of CPU and ~180 µs of wall time more here
            from redis.exceptions import ResponseError

            bucket, user, *args = calls[0]
            keys = (bucket, user) if user else (bucket,)
            try:
                return [await self._client.evalsha(SCRIPT_SHA, len(keys), *keys, *args)]
            except ResponseError as exc:  # NOSCRIPT included: the caller loads it and sends again
                return [exc]
        pipe = redis_connect.pipeline(self._client)
        for bucket, user, *args in calls:
            keys = (bucket, user) if user else (bucket,)
            pipe.evalsha(SCRIPT_SHA, len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)

    async def start(self) -> None:
        """Connect and load the script before the first request needs them (a failure is logged; the
        first requests then go unchecked)."""
        try:
            await asyncio.wait_for(self._client.script_load(SCRIPT), CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        if self._clock() >= self._resume_at:  # once per outage, not per request
            log.warning("rate limits: Redis failed (%s); requests are admitted without limits for %gs",
                        type(exc).__name__, BACKOFF_S)
        self._resume_at = self._clock() + BACKOFF_S

    async def close(self) -> None:
        for task in list(self._sending):
            task.cancel()
        await self._client.aclose()


def _retrieved(answer: asyncio.Future) -> None:
    """A late answer's error is read here (its request went on unchecked): asyncio would log it."""
    if not answer.cancelled():
        answer.exception()

"""Budgets shared by every gateway through Redis: one script call per request, bounded in time.

The script (the token bucket of bucket.py, on Redis's clock so gateways' clocks need not agree) reads
AIBrix's user record first when asked, takes or charges atomically and returns what is left: one round
trip. A request waits at most `timeout` for it; on a timeout or an error the request is admitted
(fail open: losing Redis never fails requests, it lifts the limits) and Redis is left alone for
BACKOFF_S, so an outage costs each request nothing, not a timeout each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from extproc.ratelimit.bucket import WINDOW_S, Verdict
from extproc.ratelimit.settings import Limits

log = logging.getLogger(__name__)

BACKOFF_S = 1.0
CHARGE_TIMEOUT_S = 1.0  # output tokens are charged in the background: no request waits on them
KEY_PREFIX = "extproc:ratelimit:"
AIBRIX_USER_PREFIX = "aibrix-users/"  # AIBrix's user records: {"name": ..., "rpm": N, "tpm": N}

# KEYS[1]: the bucket (a hash r, t, ts); KEYS[2]: AIBrix's user record, or "" (the config's limits).
# ARGV: mode (take | charge), requests/min, tokens/min (0: unlimited), tokens to take or charge, window ms.
# Returns {admitted 0/1, exceeded ("" | requests | tokens), requests left, tokens left, rpm, tpm}.
SCRIPT = """
local rl, tl = tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, win = tonumber(ARGV[4]), tonumber(ARGV[5])
if KEYS[2] ~= '' then
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
local h = redis.call('HMGET', KEYS[1], 'r', 't', 'ts')
local r, t, ts = tonumber(h[1]) or rl, tonumber(h[2]) or tl, tonumber(h[3]) or now
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
redis.call('HSET', KEYS[1], 'r', tostring(r), 't', tostring(t), 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(full) + 1000)
return {admitted, exceeded, tostring(r), tostring(t), rl, tl}
"""


class RedisStore:
    def __init__(self, url: str, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        from redis import asyncio as aioredis  # loads only when Redis is used

        self._client = aioredis.Redis.from_url(url, socket_timeout=CHARGE_TIMEOUT_S,
                                               socket_connect_timeout=CHARGE_TIMEOUT_S)
        self._script = self._client.register_script(SCRIPT)  # EVALSHA, EVAL once after a Redis restart
        self.timeout = timeout
        self._clock = clock
        self._resume_at = 0.0  # after a failure, Redis is skipped until then
        self._charges: set[asyncio.Task] = set()
        self.failures = 0

    @staticmethod
    def key(bucket_id: str) -> str:
        return KEY_PREFIX + bucket_id

    async def take(self, bucket_id: str, limits: Limits, cost: int,
                   aibrix_user: str | None) -> tuple[Limits, Verdict] | None:
        """The verdict and the limits it was judged by (AIBrix's record may set them); None: Redis
        did not answer in time, the request goes unlimited."""
        if self._clock() < self._resume_at:
            return None
        user_key = AIBRIX_USER_PREFIX + aibrix_user if aibrix_user else ""
        try:
            reply = await asyncio.wait_for(self._script(
                keys=[self.key(bucket_id), user_key],
                args=["take", limits.requests or 0, limits.tokens or 0, cost, int(WINDOW_S * 1000)]),
                self.timeout)
        except Exception as exc:  # noqa: BLE001 (timeouts, connection errors, a script error: all fail open)
            self._failed("take", exc)
            return None
        admitted, exceeded, requests, tokens, rpm, tpm = reply
        exceeded = exceeded.decode() if isinstance(exceeded, bytes) else exceeded
        judged = Limits(int(rpm) or None, int(tpm) or None)
        return judged, Verdict(bool(admitted), exceeded or None, float(requests), float(tokens), cost)

    def charge(self, bucket_id: str, limits: Limits, tokens: int) -> None:
        """Owe `tokens` (counted output), in the background."""
        if not limits.tokens or tokens <= 0:
            return
        task = asyncio.get_running_loop().create_task(self._charge(bucket_id, limits, tokens))
        self._charges.add(task)
        task.add_done_callback(self._charges.discard)

    async def _charge(self, bucket_id: str, limits: Limits, tokens: int) -> None:
        try:
            await asyncio.wait_for(self._script(
                keys=[self.key(bucket_id), ""],
                args=["charge", limits.requests or 0, limits.tokens, tokens, int(WINDOW_S * 1000)]),
                CHARGE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            self._failed("charge", exc)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        if self._clock() >= self._resume_at:  # once per outage, not per request
            log.warning("rate limits: Redis %s failed (%s); requests are admitted without limits for "
                        "%gs", what, type(exc).__name__, BACKOFF_S)
        self._resume_at = self._clock() + BACKOFF_S

    async def close(self) -> None:
        for task in list(self._charges):
            task.cancel()
        await self._client.aclose()

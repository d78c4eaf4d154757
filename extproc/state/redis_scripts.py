"""The two Lua scripts that keep Redis's per-pod totals equal to the sum of the gateways' ledgers.

Each runs atomically on the shard holding one model's keys (all tagged `{<model>}`), so a total and
the ledgers it sums are never seen apart, and a Redis snapshot (RDB) always holds them consistent.
"""

from __future__ import annotations

import hashlib

# KEYS: running totals, token totals, this gateway's ledger, the model's members. ARGV: ttl seconds,
# this gateway, R, then R pairs (pod, in-flight), then pairs (pod, cumulative tokens). Values are
# absolute: the totals move by the difference to the ledger, so sending a batch twice changes nothing.
# Returns 1 when the ledger was missing (new gateway, reaped as silent, or Redis lost it): the caller
# then writes every value again.
WRITE = """
local fresh = redis.call('HSETNX', KEYS[3], '~', '1')
redis.call('SADD', KEYS[4], ARGV[2])
local ttl = tonumber(ARGV[1])
local last = 3 + 2 * tonumber(ARGV[3])
for i = 4, #ARGV, 2 do
  local running = i <= last
  local field = (running and 'r:' or 't:') .. ARGV[i]
  local total = running and KEYS[1] or KEYS[2]
  local n = tonumber(ARGV[i + 1])
  local old = tonumber(redis.call('HGET', KEYS[3], field) or '0')
  if n ~= old then
    if n == 0 then redis.call('HDEL', KEYS[3], field) else redis.call('HSET', KEYS[3], field, n) end
    if redis.call('HINCRBY', total, ARGV[i], n - old) <= 0 and running then
      redis.call('HDEL', total, ARGV[i])
    end
  end
end
for k = 1, 4 do redis.call('EXPIRE', KEYS[k], ttl) end
return fresh
"""

# KEYS: running totals, a silent gateway's ledger, the model's members. ARGV: that gateway. Takes its
# in-flight share out of the totals, once (the marker goes with it); its cumulative tokens stay
# counted, and stay in its ledger so that, if it was only paused, its writing them again adds nothing.
REAP = """
redis.call('SREM', KEYS[3], ARGV[1])
if redis.call('HDEL', KEYS[2], '~') == 0 then return 0 end
local fields = redis.call('HGETALL', KEYS[2])
for i = 1, #fields, 2 do
  if string.sub(fields[i], 1, 2) == 'r:' then
    local pod = string.sub(fields[i], 3)
    if redis.call('HINCRBY', KEYS[1], pod, -tonumber(fields[i + 1])) <= 0 then
      redis.call('HDEL', KEYS[1], pod)
    end
    redis.call('HDEL', KEYS[2], fields[i])
  end
end
return 1
"""

WRITE_SHA = hashlib.sha1(WRITE.encode()).hexdigest()
REAP_SHA = hashlib.sha1(REAP.encode()).hexdigest()

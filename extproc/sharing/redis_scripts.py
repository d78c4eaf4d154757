"""The two Lua scripts that keep Redis's per-pod totals equal to the sum of the gateways' ledgers.

Each runs atomically on the shard holding one model's keys (all tagged `{<model>}`), so a total and
the ledgers it sums are never seen apart, and a Redis snapshot (RDB) always holds them consistent.
"""

from __future__ import annotations

import hashlib

from extproc.sharing.packed_totals import COMPACT_SLACK, HEADER_BYTES, VALUE_FORMAT
from extproc.sharing.speed_sums import ROUNDING, SHARED_TAUS

# Speed evidence (sharing/speed_sums.py, whose `move` this mirrors): a vector is little-endian doubles,
# measured, then per group t,w,x,y,xx,xy,yy,n (binary: text cost Redis 100 us a pod in parsing and
# formatting, this 18). `move` decays each group of total, old share and new share to the latest of
# their times and returns the total less old plus new, or nil when no sum is left.
_VECTORS = """
local TAUS = {TAUS_HERE}
local WIDTH = 1 + 8 * #TAUS
local FMT = '<' .. string.rep('d', WIDTH)
local ROUNDING = ROUNDING_HERE
local function parse(s)
  if s and #s == 8 * WIDTH then return {struct.unpack(FMT, s)} end
  return nil
end
local function move(total, old, new)
  local out = {0}
  for _, v in ipairs({total or false, old or false, new or false}) do
    if v and v[1] > out[1] then out[1] = v[1] end
  end
  local left = false
  for g = 1, #TAUS do
    local i = 2 + 8 * (g - 1)
    local at = -1e308
    if total and total[i] > at then at = total[i] end
    if old and old[i] > at then at = old[i] end
    if new and new[i] > at then at = new[i] end
    local ft = total and math.exp((total[i] - at) / TAUS[g]) or 0
    local fo = old and math.exp((old[i] - at) / TAUS[g]) or 0
    local fn = new and math.exp((new[i] - at) / TAUS[g]) or 0
    out[i] = at
    for k = i + 1, i + 7 do
      local a, b, c = total and ft * total[k] or 0, old and fo * old[k] or 0, new and fn * new[k] or 0
      local s = a - b + c
      -- what rounding leaves of a share taken out is 0
      if s > ROUNDING * (math.abs(a) + math.abs(b) + math.abs(c)) then left = true else s = 0 end
      out[k] = s
    end
  end
  if left then return out end
  return nil
end
local function store(key, field, v)
  if v == nil then redis.call('HDEL', key, field)
  else redis.call('HSET', key, field, struct.pack(FMT, unpack(v, 1, WIDTH))) end
end
""".replace("TAUS_HERE", ", ".join(repr(t) for t in SHARED_TAUS)).replace("ROUNDING_HERE", repr(ROUNDING))


# The running totals packed (sharing/packed_totals.py), kept by every script that moves them: a string
# of a 16-character epoch then one little-endian int32 per slot, a hash pod -> slot, and a list of the
# epoch then each slot's pod (so a reader fetches only the slots it has not seen). Slots are given out
# in order and never reused while the keys live. `ensure` rebuilds all three from the totals hash, under
# a new epoch, when any is missing (new model, expired, or written by a version without them), or when
# slots of pods long gone pile up (pods replaced over weeks would otherwise grow the string for ever).
# `k` holds the keys: running, packed, slots, names.
_PACKED = """
local function slot_of(k, pod)
  local s = redis.call('HGET', k.slots, pod)
  if s then return tonumber(s) end
  s = redis.call('RPUSH', k.names, pod) - 2
  redis.call('HSET', k.slots, pod, s)
  return s
end
local function put(k, pod, v)
  if v <= 0 then
    if not redis.call('HGET', k.slots, pod) then return end  -- no slot reads as 0 already
    v = 0
  end
  redis.call('SETRANGE', k.packed, HEADER_HERE + 4 * slot_of(k, pod), struct.pack('VALUE_HERE', v))
end
local function ensure(k)
  local slots = redis.call('LLEN', k.names) - 1
  if slots >= 0 and redis.call('EXISTS', k.packed) == 1
      and slots <= 2 * redis.call('HLEN', k.running) + SLACK_HERE then return end
  local before = redis.call('LINDEX', k.names, 0)
  redis.call('DEL', k.names, k.slots, k.packed)
  local t = redis.call('TIME')
  local epoch = string.format('%010d%06d', tonumber(t[1]), tonumber(t[2]))
  if epoch == before then  -- rebuilt twice within a microsecond: readers must still see a new epoch
    epoch = string.format('%010d%06d', tonumber(t[1]), tonumber(t[2]) + 1)
  end
  redis.call('RPUSH', k.names, epoch)
  redis.call('SET', k.packed, epoch)
  local f = redis.call('HGETALL', k.running)
  for i = 1, #f, 2 do put(k, f[i], tonumber(f[i + 1])) end
end
"""
for _name, _value in (("HEADER_HERE", HEADER_BYTES), ("SLACK_HERE", COMPACT_SLACK),
                      ("VALUE_HERE", VALUE_FORMAT)):
    _PACKED = _PACKED.replace(_name, str(_value))

# KEYS: running totals, token totals, this gateway's ledger, the model's members, the model's speed
# sums (only its expiry refreshed, with the ledger that holds this gateway's share), then the packed
# totals, their slots and slot names. ARGV: ttl seconds,
# this gateway, R, then R pairs (pod, in-flight), then pairs (pod, cumulative tokens). Values are
# absolute: the totals move by the difference to the ledger, so sending a batch twice changes nothing.
# Returns 1 when the ledger was missing (new gateway, reaped as silent, or Redis lost it): the caller
# then writes every value again.
WRITE = _PACKED + """
local k = {running = KEYS[1], packed = KEYS[6], slots = KEYS[7], names = KEYS[8]}
ensure(k)
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
    local now = redis.call('HINCRBY', total, ARGV[i], n - old)
    if running then
      if now <= 0 then redis.call('HDEL', total, ARGV[i]) end
      put(k, ARGV[i], now)
    end
  end
end
for k = 1, #KEYS do redis.call('EXPIRE', KEYS[k], ttl) end
return fresh
"""

# KEYS: the model's speed sums, this gateway's ledger. ARGV: ttl seconds, then pairs (pod, this
# gateway's whole evidence on it, empty to withdraw it). The ledger keeps each share ("s:<pod>"), so
# resending a batch changes nothing and a reaped gateway's share can leave the sums.
SPEED = _VECTORS + """
for i = 2, #ARGV, 2 do
  local field = 's:' .. ARGV[i]
  local new = parse(ARGV[i + 1])
  local old = parse(redis.call('HGET', KEYS[2], field))
  local total = parse(redis.call('HGET', KEYS[1], ARGV[i]))
  store(KEYS[1], ARGV[i], move(total, old, new))
  if new then redis.call('HSET', KEYS[2], field, ARGV[i + 1]) else redis.call('HDEL', KEYS[2], field) end
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return 0
"""

# KEYS: running totals, a silent gateway's ledger, the model's members, the model's speed sums, the
# packed totals, their slots and slot names. ARGV: that gateway. Takes its in-flight share (from both
# forms of the totals) and its speed evidence out, once (the marker goes with it); its cumulative
# tokens stay counted, and stay in its ledger so that, if it was only paused, its writing them again
# adds nothing.
REAP = _VECTORS + _PACKED + """
local k = {running = KEYS[1], packed = KEYS[5], slots = KEYS[6], names = KEYS[7]}
redis.call('SREM', KEYS[3], ARGV[1])
if redis.call('HDEL', KEYS[2], '~') == 0 then return 0 end
ensure(k)
local fields = redis.call('HGETALL', KEYS[2])
for i = 1, #fields, 2 do
  local kind, pod = string.sub(fields[i], 1, 2), string.sub(fields[i], 3)
  if kind == 'r:' then
    local now = redis.call('HINCRBY', KEYS[1], pod, -tonumber(fields[i + 1]))
    if now <= 0 then redis.call('HDEL', KEYS[1], pod) end
    put(k, pod, now)
    redis.call('HDEL', KEYS[2], fields[i])
  elseif kind == 's:' then
    store(KEYS[4], pod, move(parse(redis.call('HGET', KEYS[4], pod)), parse(fields[i + 1]), nil))
    redis.call('HDEL', KEYS[2], fields[i])
  end
end
return 1
"""

# KEYS: the packed totals, their slot names. ARGV: the epoch the reader knows ("" for none), how many
# entries of the names list it has (epoch included). Returns the packed string (nil: none yet), where
# the names returned start (0: afresh, the epoch first; the epoch changed or the list shrank, as after
# a restart from an older snapshot) and those names. One atomic read: names and values agree.
READ = """
local packed = redis.call('GET', KEYS[1])
if not packed then return {false, 0, {}} end
local from = tonumber(ARGV[2])
if from > 0 and (redis.call('LINDEX', KEYS[2], 0) ~= ARGV[1] or redis.call('LLEN', KEYS[2]) < from) then
  from = 0
end
return {packed, from, redis.call('LRANGE', KEYS[2], from, -1)}
"""

WRITE_SHA = hashlib.sha1(WRITE.encode()).hexdigest()
# KEYS: the heartbeat set (it only routes the call, on a cluster, to the shard whose clock the
# heartbeats are scored by). Redis's TIME, which a cluster pipeline will not send.
CLOCK = "return redis.call('TIME')"

CLOCK_SHA = hashlib.sha1(CLOCK.encode()).hexdigest()
SPEED_SHA = hashlib.sha1(SPEED.encode()).hexdigest()
REAP_SHA = hashlib.sha1(REAP.encode()).hexdigest()
READ_SHA = hashlib.sha1(READ.encode()).hexdigest()

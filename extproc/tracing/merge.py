"""Merges one gateway's trace window into the shared one in Redis, atomically (a Lua script).

AIBrix's gateway SETs its window, so with N gateways the last writer wins and the optimizer plans from
about 1/N of the load. The key stays a JSON string (AIBrix's GatewayLoadReader GETs and parses it), so
the merge reads it, adds ours and writes it back inside one script: counts, meta_total_reqs and the
in-flight gauges (meta_pending_reqs, meta_queueing_reqs: each gateway's own) add up; the latency
histograms (`meta_tpot`, `meta_ttft`, `meta_e2e`, `meta_tpat`) add up per deployment and bucket, the
`meta_rejected` counts per deployment. `meta_writers` lists the writes merged so far, so a retry of a
write that did land (a timeout after Redis ran the script) is not counted twice. Readers skip `meta_`
keys they do not know (AIBrix's and ours), so the value stays readable by both.
"""

from __future__ import annotations

from typing import Any, Protocol

from extproc.tracing.window import LATENCY_KEYS

WRITERS_KEY = "meta_writers"

# KEYS[1] the window's key; ARGV[1] our window as JSON, ARGV[2] the TTL in seconds, ARGV[3] this write's
# id. Returns 1 when merged, 0 when this write was merged before. A value that is not a JSON object
# (nothing a gateway writes) is replaced rather than failing every gateway's write for the window.
MERGE_LUA = """
local histograms = {%s}
local ours = cjson.decode(ARGV[1])
local ok, cur = pcall(cjson.decode, redis.call('GET', KEYS[1]) or 'null')
if not ok or type(cur) ~= 'table' then cur = {} end
local writers = cur['meta_writers']
if type(writers) ~= 'table' then writers = {} end
for _, w in ipairs(writers) do
  if w == ARGV[3] then return 0 end
end
table.insert(writers, ARGV[3])
local function num(x) return tonumber(x) or 0 end
for k, v in pairs(ours) do
  if histograms[k] then
    local tpot = cur[k]
    if type(tpot) ~= 'table' then tpot = {} end
    for dep, hist in pairs(v) do
      local h = tpot[dep]
      if type(h) ~= 'table' then h = {} end
      for b, n in pairs(hist) do h[b] = num(h[b]) + n end
      tpot[dep] = h
    end
    cur[k] = tpot
  elseif k == 'meta_rejected' then
    local rej = cur[k]
    if type(rej) ~= 'table' then rej = {} end
    for dep, n in pairs(v) do rej[dep] = num(rej[dep]) + n end
    cur[k] = rej
  elseif k == 'meta_v' or k == 'meta_interval_sec' or k == 'meta_precision' then
    cur[k] = v
  else
    cur[k] = num(cur[k]) + v
  end
end
cur['meta_writers'] = writers
redis.call('SET', KEYS[1], cjson.encode(cur), 'EX', ARGV[2])
return 1
""" % ", ".join(f"{key} = true" for key in sorted(LATENCY_KEYS.values()))


class _Script(Protocol):
    async def __call__(self, keys: list[str], args: list[Any]) -> Any: ...


class ScriptingRedis(Protocol):
    def register_script(self, script: str) -> _Script: ...


class WindowMerger:
    """`merge(key, value, ttl, write_id)`: one EVALSHA (redis-py loads the script on first use)."""

    def __init__(self, redis_client: ScriptingRedis) -> None:
        self._script = redis_client.register_script(MERGE_LUA)

    async def merge(self, key: str, value: str, ttl: int, write_id: str) -> bool:
        return bool(await self._script(keys=[key], args=[value, ttl, write_id]))

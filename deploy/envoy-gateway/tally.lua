-- Response-side token tally, run inside Envoy (HTTP Lua filter) for every routed request.
--
-- Envoy streams the response to the client untouched by the gateway process; this script reads the
-- body as it passes and leaves one summary in dynamic metadata (namespace "extproc.tally"), which the
-- gRPC access log delivers to the gateway once per request. So a generation never depends on the
-- gateway process staying up, and the gateway handles one message per request instead of one per token.
--
-- Metadata written (all optional):
--   output_tokens  usage.completion_tokens / usage.output_tokens, else the content-bearing SSE events
--   prompt_tokens  usage.prompt_tokens / usage.input_tokens
--   source         "usage" | "counted" | "unknown" (encoded body, unparsable, or over the size cap)
-- When the gateway asked the engine for usage on the client's behalf (metadata extproc.strip_usage),
-- the usage-only SSE event is removed so the client sees what the engine would have sent it.

local NS = "extproc.tally"
local MAX_JSON_BYTES = 16 * 1024 * 1024 -- Envoy's own per-connection buffer limit
local MAX_LINE_BYTES = 1024 * 1024      -- one SSE line longer than this is not ours to parse
local RUNNING_COUNT_EVERY = 16

-- The last unescaped `"usage": {` object in s: prompt and output token counts, or nil.
local function find_usage(s)
  local pos, open = 1, nil
  while true do
    local a, b = string.find(s, '"usage"%s*:%s*{', pos)
    if not a then break end
    if a == 1 or string.sub(s, a - 1, a - 1) ~= "\\" then open = b end
    pos = b + 1
  end
  if not open then return nil end
  -- usage holds numbers and nested detail objects only: count braces to its end.
  local depth, i, n = 0, open, #s
  while i <= n do
    local c = string.byte(s, i)
    if c == 123 then depth = depth + 1 elseif c == 125 then
      depth = depth - 1
      if depth == 0 then break end
    end
    i = i + 1
  end
  local obj = string.sub(s, open, i)
  local out = string.match(obj, '"completion_tokens"%s*:%s*(%d+)') or
              string.match(obj, '"output_tokens"%s*:%s*(%d+)')
  local inp = string.match(obj, '"prompt_tokens"%s*:%s*(%d+)') or
              string.match(obj, '"input_tokens"%s*:%s*(%d+)')
  if not out then return nil end
  return tonumber(inp), tonumber(out)
end

-- A data payload that carries generated text: chat delta content, completion text, Responses API delta.
local function has_content(payload)
  return string.find(payload, '"content"%s*:%s*"[^"]') or string.find(payload, '"text"%s*:%s*"[^"]') or
         string.find(payload, '"type"%s*:%s*"response%.output_text%.delta"')
end

-- An incremental SSE reader: feed it chunks in any split, it sees whole lines.
local Sse = {}
Sse.__index = Sse

function Sse.new(strip)
  return setmetatable({carry = "", counted = 0, prompt = nil, output = nil, strip = strip,
                       skip_blank = false, broken = false}, Sse)
end

-- Consume one chunk; return the bytes to forward (only differs from `data` when stripping).
function Sse:feed(data)
  local text = self.carry .. data
  local start, n = 1, #text
  local keep = self.strip and {} or nil
  while true do
    local nl = string.find(text, "\n", start, true)
    if not nl then break end
    local line = string.sub(text, start, nl)
    local drop = self:line(line)
    if keep and not drop then keep[#keep + 1] = line end
    start = nl + 1
  end
  self.carry = string.sub(text, start)
  if #self.carry > MAX_LINE_BYTES then
    self.broken = true -- not an SSE stream we understand; pass it on, stop counting
    local rest = self.carry
    self.carry = ""
    if keep then keep[#keep + 1] = rest end
  end
  if keep then return table.concat(keep) end
  return data
end

-- Returns true when the line is to be dropped (the usage-only event and the blank line ending it).
function Sse:line(line)
  if self.skip_blank then
    self.skip_blank = false
    if line == "\n" or line == "\r\n" then return true end
  end
  if string.sub(line, 1, 5) ~= "data:" then return false end
  local payload = string.sub(line, 6)
  if string.find(payload, '"usage"', 1, true) then
    local inp, out = find_usage(payload)
    if out then
      self.prompt, self.output = inp, out
      if self.strip and string.find(payload, '"choices"%s*:%s*%[%s*%]') then
        self.skip_blank = true
        return true
      end
    end
  end
  if has_content(payload) then self.counted = self.counted + 1 end
  return false
end

-- The stream ended: read a last line without a newline. Returns the bytes still held back, which
-- only a stripping reader holds (Envoy cannot send them after the last chunk; SSE clients discard an
-- unterminated event anyway).
function Sse:finish()
  local rest = self.carry
  self.carry = ""
  if rest ~= "" then self:line(rest) end
  if self.strip then return rest end
  return ""
end

-- Envoy's handles die at every yield (each body chunk): fetch the metadata object afresh each time.
local function publish(handle, prompt, output, source)
  local meta = handle:streamInfo():dynamicMetadata()
  if prompt then meta:set(NS, "prompt_tokens", prompt) end
  if output then meta:set(NS, "output_tokens", output) end
  meta:set(NS, "source", source)
end

function envoy_on_response(handle)
  local routed = handle:streamInfo():dynamicMetadata():get("extproc")
  if routed == nil or routed["pod"] == nil then return end -- not routed by the gateway (its own replies, Envoy's)
  local headers = handle:headers()
  local status = tonumber(headers:get(":status")) or 0
  if status >= 400 then
    publish(handle, nil, 0, "usage") -- error statuses add no tokens
    return
  end
  local encoding = headers:get("content-encoding")
  if encoding ~= nil and encoding ~= "identity" then
    publish(handle, nil, nil, "unknown") -- never mis-tally a compressed body
    return
  end
  local ctype = headers:get("content-type") or ""
  if string.find(ctype, "text/event-stream", 1, true) then
    local strip = routed["strip_usage"] == true
    if strip then headers:remove("content-length") end
    local sse = Sse.new(strip)
    local published = 0
    for chunk in handle:bodyChunks() do
      local n = chunk:length()
      if n > 0 then
        local out = sse:feed(chunk:getBytes(0, n))
        if strip then chunk:setBytes(out) end
      end
      -- A running count, so a stream cut short still reports what it delivered: every
      -- RUNNING_COUNT_EVERY events, since a metadata write costs more than reading the chunk.
      if not sse.broken and sse.output == nil and sse.counted - published >= RUNNING_COUNT_EVERY then
        published = sse.counted
        handle:streamInfo():dynamicMetadata():set(NS, "output_tokens", published)
      end
    end
    sse:finish()
    if sse.broken then publish(handle, nil, nil, "unknown")
    elseif sse.output ~= nil then publish(handle, sse.prompt, sse.output, "usage")
    else publish(handle, nil, sse.counted, "counted") end
    return
  end
  -- A JSON body: usage sits near its end; keep it whole up to Envoy's own buffer limit.
  local parts, size = {}, 0
  for chunk in handle:bodyChunks() do
    local n = chunk:length()
    size = size + n
    if size <= MAX_JSON_BYTES and n > 0 then parts[#parts + 1] = chunk:getBytes(0, n) end
  end
  if size > MAX_JSON_BYTES then
    publish(handle, nil, nil, "unknown")
    return
  end
  local prompt, output = find_usage(table.concat(parts))
  if output then publish(handle, prompt, output, "usage") else publish(handle, nil, nil, "unknown") end
end

-- For unit tests run outside Envoy (lupa): the parser without the Envoy handle.
return {Sse = Sse, find_usage = find_usage}

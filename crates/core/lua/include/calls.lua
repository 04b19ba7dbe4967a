-- @include units
-- calls: the seller's calls (the exact algorithms): each call granted holds its place from its
-- grant until its answer (calls_gate), and is ended when the answer comes (end_call).
-- Defines: calls_gate, after_gate, keep_calls, start_call, end_call

-- Calls (the exact algorithms): every call granted occupies the time from its grant until its
-- answer, because the downstream may count it at any moment in between. The seller's calls
-- (sorted set CALLS: the units of each call TOKEN, see unit; score = the call's END: while it
-- is in flight, its grant + BOUND, the latest its answer or timeout can come back; once
-- answered, when its answer came back, see ended.lua) keep every call whose END lies within
-- the stack's longest window: a call that ended earlier cannot share a window with one starting
-- now. A new call of COST units may start only while, for every limit, the units whose END lies
-- within its WINDOW leave room for COST more; then, whatever each call's latency, no window of
-- the downstream holds more than COUNT units of any limit (docs/guarantees.md, "Exact whatever the
-- latency").
-- Returns nil when a call may start now, else when to ask again: when enough ENDs leave every
-- window. An END already past is when that call's answer came (or its bound), so the window
-- opens exactly then; while one that decides is still in flight (its END is its BOUND), no later
-- than GUARD (at least 25 ms) from now: an answer usually comes much sooner.
-- WIDTH is 'window' (a seller's calls: its windows' guard is kept in its log) or 'span' (the
-- global log, whose units are its calls: each window + its guard); 'window' when absent.
local function calls_gate(calls_key, now, limits, cost, width)
  width = width or 'window'
  redis.call('ZREMRANGEBYSCORE', calls_key, '-inf', now - limits['max_' .. width])
  local open_at = nil
  local in_flight = false
  for _, l in ipairs(limits) do
    -- A calendar limit counts each call in every window its answer may fall in (calendar.lua).
    if l.phase == nil then
      local n = redis.call('ZCOUNT', calls_key, string.format('(%.0f', now - l[width]), '+inf')
      l.in_flight = n
      local room = l.count - cost
      if n > room then
        local kth = tonumber(redis.call('ZREVRANGE', calls_key, room, room, 'WITHSCORES')[2])
        open_at = math.max(open_at or 0, kth + l[width])
        if kth > now then in_flight = true end
      end
    end
  end
  if open_at == nil or not in_flight then return open_at end
  return math.min(open_at, now + math.max(limits.min_guard, 25000))
end

-- A due STATUS (1) held back by calls_gate becomes a reservation at the time the gate may open
-- (or a denial, come back then, when the caller does not reserve). Returns SLOT, STATUS.
local function after_gate(status, slot, calls_key, now, limits, a)
  if status ~= 1 then return slot, status end
  local open_at = calls_gate(calls_key, now, limits, a.cost)
  if not open_at then return slot, status end
  return math.max(open_at, slot), (a.reserve == 1 and 2 or 0)
end

-- Keeps the seller's calls (CALLS_KEY) at least LAST µs from now, never shortening what it
-- had: a permit block's units end later than a call granted now (see take_block).
local function keep_calls(calls_key, last)
  local ttl = math.floor(last / 1000) + 1
  if redis.call('PTTL', calls_key) < ttl then redis.call('PEXPIRE', calls_key, ttl) end
end

-- Records a call of COST units granted now with TOKEN: in flight until now + BOUND at the latest.
local function start_call(calls_key, token, cost, now, bound, limits)
  add_units(calls_key, now + bound, token, cost)
  keep_calls(calls_key, bound + limits.max_window)
end

-- Records that the call TOKEN was answered at AT (see answered_arg): the END of each of its
-- units comes forward to AT (never back). With its COST known (>= 1) exactly its units move;
-- without (0), they are moved 64 at a time (ZADD XX touches only those that exist) until a batch
-- finds fewer: a few calls for any cost.
local function end_call(calls_key, token, at, cost)
  local bound = tonumber(redis.call('ZSCORE', calls_key, token) or '')
  if bound == nil or at >= bound then return end
  redis.call('ZADD', calls_key, at, token)
  if cost >= 1 then
    if cost > 1 then
      local args = {}
      for i = 2, cost do
        args[#args + 1] = at
        args[#args + 1] = unit(token, i)
      end
      redis.call('ZADD', calls_key, 'XX', unpack(args))
    end
    return
  end
  local first = 2
  repeat
    local args = {}
    for i = first, first + 63 do
      args[#args + 1] = at
      args[#args + 1] = unit(token, i)
    end
    local moved = redis.call('ZADD', calls_key, 'XX', 'CH', unpack(args))
    first = first + 64
  until moved < 64
end

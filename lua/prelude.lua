-- prelude: prepended to every turnstile script (see src/permit/scripts.rs). Defines helpers
-- only; reads and writes nothing by itself.

-- ARGV[i] as an integer >= min, or the script fails before anything is written.
local function int_arg(i, min)
  local v = tonumber(ARGV[i])
  if v == nil or v ~= math.floor(v) or v < min then
    error({err = 'ERR turnstile: ARGV[' .. i .. '] must be an integer >= ' .. min})
  end
  return v
end

-- ARGV[i] as a reservation TOKEN (1 to 64 letters, digits or dashes), or the script fails
-- before anything is written.
local function token_arg(i)
  local token = ARGV[i]
  if token == nil or not string.match(token, '^[%w-]+$') or #token > 64 then
    error({err = 'ERR turnstile: TOKEN must be 1 to 64 letters, digits or dashes'})
  end
  return token
end

-- The limit that applies: the seller's override ("COUNT WINDOW_US") if set, else the default.
local function effective_limit(override_key, count, window)
  local override = redis.call('GET', override_key)
  if override then
    local c, w = string.match(override, '^(%d+) (%d+)$')
    if c and tonumber(c) >= 1 and tonumber(w) >= 1 then return tonumber(c), tonumber(w) end
  end
  return count, window
end

-- Guard added to a window (µs): as configured, or window/20 within [25 ms, 2 s] when < 0.
local function guard_for(window, guard)
  if guard >= 0 then return guard end
  return math.min(math.max(math.floor(window / 20), 25000), 2000000)
end

-- Redis server time in µs: the only clock a limit is measured on.
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The seller's pause end in µs (0 when not paused).
local function paused_until(pause_key)
  return tonumber(redis.call('GET', pause_key) or '0')
end

-- The common arguments of the acquire scripts (see each script's header).
local function acquire_args()
  local a = {
    count = int_arg(1, 1), window = int_arg(2, 1), guard = int_arg(3, -1),
    flags = int_arg(4, 0), horizon = int_arg(5, 0),
  }
  if a.flags > 3 then error({err = 'ERR turnstile: FLAGS must be 0 to 3'}) end
  a.token = token_arg(6)
  a.reserve = a.flags % 2
  a.durable = a.flags >= 2
  return a
end

-- The answer of the acquire scripts, shared so that they decide alike:
-- granted if the slot is due within EARLY (guard/10), else reserved, or denied when reserving
-- is off or the slot lies beyond the horizon.
local function due(slot, now, guard, a)
  local wait = slot - now
  if wait <= math.floor(guard / 10) then return 1 end
  if a.reserve == 0 or wait > a.horizon then return 0 end
  return 2
end

-- Whether the message already registered: its completion record (KEYS[n] if passed) says
-- `registered` (or `1`, as earlier versions wrote it). A dead letter's record (`dead:<REASON>`)
-- is not done: a replayed or duplicate copy is called again (see complete.lua).
local function already_done(key)
  if key == nil then return false end
  local state = redis.call('GET', key)
  return state == 'registered' or state == '1'
end

-- After Redis lost its data (a restart without persistence), calls granted just before it may
-- still count at the downstream. So a seller without state, on a Redis that started less than
-- SPAN ago, is paused until SPAN after the start: a restart never lets a second window's worth
-- through. (uptime is whole seconds: the start is taken as late as it can have been.)
local server_info = nil
-- This Redis server's run id (new at every start) and uptime in seconds, read once per call.
local function server()
  if server_info == nil then
    local info = redis.call('INFO', 'server')
    server_info = {
      run_id = string.match(info, 'run_id:(%x+)') or '',
      uptime = tonumber(string.match(info, 'uptime_in_seconds:(%d+)')),
    }
  end
  return server_info
end

local function cold_start(state_key, pause_key, span, now, durable)
  if durable or redis.call('EXISTS', state_key) == 1 then return end
  local up = server().uptime
  if up == nil or up * 1000000 >= span then return end
  local until_us = now - up * 1000000 + span
  if until_us > paused_until(pause_key) then
    redis.call('SET', pause_key, string.format('%.0f', until_us), 'PX', math.floor((until_us - now) / 1000) + 1)
  end
end

-- A reserved slot is bound to its TOKEN: the seller's reserved set (member TOKEN, score SLOT)
-- holds every reservation not yet redeemed, and redeem.lua consumes the entry, so a
-- reservation is good once, and only for the caller that holds its token. An entry more than
-- GUARD past its slot can no longer be redeemed (too late): it is pruned, and the set expires
-- GUARD after its last slot.
local function hold_reservation(key, token, slot, now, guard)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - guard)
  redis.call('ZADD', key, slot, token)
  local last = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
  redis.call('PEXPIRE', key, math.floor((last - now + guard) / 1000) + 1)
end

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
    reserve = int_arg(4, 0), horizon = int_arg(5, 0),
  }
  if a.reserve > 1 then error({err = 'ERR turnstile: RESERVE must be 0 or 1'}) end
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

-- Whether the message already registered (its completion record exists, KEYS[n] if passed).
local function already_done(key)
  return key ~= nil and redis.call('EXISTS', key) == 1
end

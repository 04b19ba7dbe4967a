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
  a.bound = int_arg(7, 0)
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

-- Most slots a seller holds reserved at once: beyond them, a waiting caller is told when to come
-- back without a slot (far_ticket), so a seller's state stays bounded however deep its backlog.
local MAX_RESERVED = 3072

-- How late past its slot a reservation may still be redeemed (µs). The exact algorithms check
-- every grant against the calls of the last window (calls_gate), so a late call cannot break
-- their limit: a message late for its slot (it waited for a worker, the broker was slow) is
-- still served up to one window + guard late. The others count the call at its slot only:
-- GUARD/2.
local function lateness(algorithm, window, guard)
  if algorithm == 'sliding-window' or algorithm == 'gcra' then return window + guard end
  return math.floor(guard / 2)
end

-- Whether the seller's reserved set is full (see MAX_RESERVED), once entries that can no longer
-- be redeemed (more than LATE past their slot, see lateness) are pruned.
local function reserved_full(reserved_key, now, late)
  redis.call('ZREMRANGEBYSCORE', reserved_key, '-inf', now - late)
  return redis.call('ZCARD', reserved_key) >= MAX_RESERVED
end

-- When a caller turned away by a full reserved set should come back (Redis µs): its place in
-- the seller's far queue (FAR_KEY, hash: `at` = when the next callers come back, `n` = how many
-- were told `at`). The far queue lets COUNT callers come back per SPAN, from one emission
-- interval (SPAN/COUNT) after the first reserved slot is due: the pace at which reserved slots
-- are redeemed and free room, so each comes back about when there is room to reserve, and a
-- backlog however deep is told when to come back in order, never all at once. Two numbers.
local function far_ticket(far_key, reserved_key, now, span, count)
  local f = redis.call('HMGET', far_key, 'at', 'n')
  local at, n = tonumber(f[1]) or 0, tonumber(f[2]) or 0
  local first = tonumber(redis.call('ZRANGE', reserved_key, 0, 0, 'WITHSCORES')[2] or '') or now
  local start = math.max(now, first) + span / count
  if at < start - span then
    at, n = start, 0 -- the far queue came back long ago: start afresh
  elseif at < start then
    at = start
  end
  local ticket = at
  n = n + 1
  if n >= count then at, n = at + span, 0 end
  redis.call('HSET', far_key, 'at', string.format('%.0f', at), 'n', n)
  redis.call('PEXPIRE', far_key, math.floor((at - now + span) / 1000) + 1)
  return ticket
end

-- Whether the message already registered: its completion record (KEYS[n] if passed) says
-- `registered` (or `1`, as earlier versions wrote it). A dead letter's record (`dead:<REASON>`)
-- is not done: a replayed or duplicate copy is called again (see complete.lua).
local function already_done(key)
  if key == nil then return false end
  local state = redis.call('GET', key)
  return state == 'registered' or state == '1'
end

-- This Redis server's run id (new at every start, different on every server) and uptime in
-- seconds, read once per call.
local server_info = nil
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

-- A Redis that lost writes may have forgotten grants the downstream still counts: a restart
-- without persistence (everything lost), a restart from an older RDB snapshot or AOF with
-- `everysec` (the last writes lost), a replica promoted while it lagged. So, unless DURABLE
-- (the operator says Redis loses no acknowledged write), each seller's state is stamped with the
-- run id of the server that wrote it (STAMP_KEY, living as long as the state), and a seller
-- asked about on a server that did not write its state is paused first:
--   * on a server that started less than SPAN ago, until SPAN after the start: every grant the
--     lost writes held was made before the start, so none of them is in any window by then;
--   * on a server up for longer whose stamp names another server (a replica promoted, data
--     moved), until SPAN from now: the former server's last grants were made before now;
--   * without a stamp on a server up for longer than SPAN: a new or long-idle seller (or one
--     whose very first writes were lost with a lagging replica: see README, Faults).
-- (uptime is whole seconds: the start is taken as late as it can have been.)
local function check_server(stamp_key, state_key, pause_key, span, now, durable)
  if durable then return end
  local s = server()
  local stamp = redis.call('GET', stamp_key)
  if stamp == s.run_id then return end
  local until_us = nil
  if s.uptime ~= nil and s.uptime * 1000000 < span then
    until_us = now - s.uptime * 1000000 + span
  elseif stamp then
    until_us = now + span
  end
  if until_us ~= nil and until_us > paused_until(pause_key) then
    redis.call('SET', pause_key, string.format('%.0f', until_us), 'PX', math.floor((until_us - now) / 1000) + 1)
  end
  local ttl = math.max(redis.call('PTTL', state_key), math.floor(span / 1000)) + 1
  redis.call('SET', stamp_key, s.run_id, 'PX', ttl)
end

-- Keeps the server stamp as long as the state it vouches for (TTL in ms).
local function keep_stamp(stamp_key, ttl, durable)
  if not durable then redis.call('PEXPIRE', stamp_key, ttl) end
end

-- A reserved slot is bound to its TOKEN: the seller's reserved set (member TOKEN, score SLOT)
-- holds every reservation not yet redeemed, and redeem.lua consumes the entry, so a
-- reservation is good once, and only for the caller that holds its token. An entry more than
-- LATE past its slot (see lateness) can no longer be redeemed: reserved_full prunes it before
-- every new reservation, and the set expires LATE after its last slot.
local function hold_reservation(key, token, slot, now, late)
  -- (reserved_full has just pruned the entries more than LATE past their slot.)
  redis.call('ZADD', key, slot, token)
  local last = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
  redis.call('PEXPIRE', key, math.floor((last - now + late) / 1000) + 1)
end

-- The reserving step of every acquire script. A wait (STATUS 2) takes a slot in the seller's
-- reserved set RESERVED_KEY, unless the set is full: then it gets a ticket of the far queue
-- FAR_KEY instead (status 0: come back at the ticket's time, holding nothing; see far_ticket).
-- Returns STATUS, SLOT.
local function slot_or_far_ticket(status, slot, reserved_key, far_key, now, late, span, count)
  if status == 2 and reserved_full(reserved_key, now, late) then
    return 0, far_ticket(far_key, reserved_key, now, span, count)
  end
  return status, slot
end

-- The last step of every acquire script, once the seller's state was written to last TTL ms:
-- the server stamp STAMP_KEY lasts as long, and a wait (STATUS 2) holds its reservation in
-- RESERVED_KEY. Returns true for a wait (the script answers it), false for a grant.
local function keep_and_hold(status, ttl, stamp_key, reserved_key, slot, now, late, a)
  keep_stamp(stamp_key, ttl, a.durable)
  if status ~= 2 then return false end
  hold_reservation(reserved_key, a.token, slot, now, late)
  return true
end

-- Gives the slot reserved with TOKEN at SLOT (under a limit of COUNT per WINDOW) back to the
-- seller's state of ALGORITHM, so that the next caller may take it (the reservation itself is
-- removed from the reserved set by the caller):
--   sliding-window  its log entry (member TOKEN) is removed: exact;
--   fixed-window    its window's counter goes down by one, and the window is open again: exact;
--   token-bucket    its token goes back into the bucket (capped at CAPACITY);
--   gcra            nothing: one number (TAT) cannot free a slot inside its schedule; the slot
--                   stays unused (a capacity loss, never an excess). See reschedule.lua for
--                   giving back a whole schedule's reservations at once.
local function give_back(algorithm, state_key, token, slot, window, capacity)
  if algorithm == 'sliding-window' then
    redis.call('ZREM', state_key, token)
  elseif algorithm == 'fixed-window' then
    local index = math.floor(slot / window)
    local field = string.format('%.0f', index)
    if tonumber(redis.call('HGET', state_key, field) or '0') > 0 then
      redis.call('HINCRBY', state_key, field, -1)
      if index < tonumber(redis.call('HGET', state_key, 'next') or '0') then
        redis.call('HSET', state_key, 'next', field)
      end
    end
  elseif algorithm == 'token-bucket' then
    local tokens = tonumber(redis.call('HGET', state_key, 'tokens') or '')
    if tokens ~= nil then
      redis.call('HSET', state_key, 'tokens', string.format('%.6f', math.min(tokens + 1, capacity)))
    end
  end
end

-- ARGV[i] as one of the algorithms, or the script fails before anything is written.
local function algorithm_arg(i)
  local a = ARGV[i]
  if a ~= 'sliding-window' and a ~= 'gcra' and a ~= 'token-bucket' and a ~= 'fixed-window' then
    error({err = 'ERR turnstile: ARGV[' .. i .. '] must be an algorithm'})
  end
  return a
end

-- Calls (the exact algorithms): every call granted occupies the time from its grant until its
-- answer, because the downstream may count it at any moment in between. The seller's calls
-- (sorted set CALLS: member TOKEN, score = the call's END: while it is in flight, its grant +
-- BOUND, the latest its answer or timeout can come back; once answered, when the answer was
-- recorded, see ended.lua) keep every call whose END lies within the last WINDOW: a call that
-- ended earlier cannot share a window with one starting now. A new call may start only while
-- fewer than COUNT are kept; then, whatever each call's latency, no window of the downstream
-- holds more than COUNT (README, "Exact whatever the latency").
-- Returns nil when a call may start now, else when to ask again: when the COUNT-th latest END
-- leaves the window if every call in flight takes its whole BOUND, but no later than GUARD
-- from now (an answer usually comes much sooner).
local function calls_gate(calls_key, now, window, count, guard)
  redis.call('ZREMRANGEBYSCORE', calls_key, '-inf', now - window)
  local n = redis.call('ZCARD', calls_key)
  if n < count then return nil end
  local kth = tonumber(redis.call('ZRANGE', calls_key, n - count, n - count, 'WITHSCORES')[2])
  return math.min(kth + window, now + math.max(guard, 1000))
end

-- A due STATUS (1) held back by calls_gate becomes a reservation at the time the gate may open
-- (or a denial, come back then, when the caller does not reserve). Returns SLOT, STATUS.
local function after_gate(status, slot, calls_key, now, window, count, guard, reserve)
  if status ~= 1 then return slot, status end
  local open_at = calls_gate(calls_key, now, window, count, guard)
  if not open_at then return slot, status end
  return math.max(open_at, slot), (reserve == 1 and 2 or 0)
end

-- Records a call granted now with TOKEN: in flight until now + BOUND at the latest.
local function start_call(calls_key, token, now, bound, window)
  redis.call('ZADD', calls_key, now + bound, token)
  redis.call('PEXPIRE', calls_key, math.floor((bound + window) / 1000) + 1)
end

-- Records that the call TOKEN was answered now: its END comes forward (never back).
local function end_call(calls_key, token, now)
  local bound = tonumber(redis.call('ZSCORE', calls_key, token) or '')
  if bound ~= nil and now < bound then redis.call('ZADD', calls_key, now, token) end
end

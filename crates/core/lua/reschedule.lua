-- reschedule: changes the terms of a seller (sets or clears its limit override, lifts its
-- pause) and, in the same atomic step, gives back every slot reserved under the old terms, so
-- that the new terms apply at once to the seller's whole backlog: the holders of those
-- reservations find them gone when they come back (redeem answers 8) and reserve anew, and
-- slots are computed afresh from what was really granted.
--   sliding-window  every reserved entry leaves the log: exact;
--   fixed-window    every reserved slot leaves its window's counter: exact;
--   token-bucket    the bucket is brought to now, every reserved token goes back into it
--                   (between 0 and CAPACITY: only reservations run into debt);
--   gcra            the TAT moves back by one emission interval per reserved slot that lies
--                   after every call made (later than GUARD/10 from now): those are the end of
--                   the schedule (a grant is only made when no slot lies ahead), so what is
--                   left is the schedule of the calls, at most BURST intervals past the latest
--                   a grant may be (a pause folded into the TAT ends there); its cells are then
--                   spaced at the new limit's interval, at most one new window ahead (by then
--                   every earlier call has left any window).
--   fixed-window counters are kept per window index: a new WINDOW length starts new indexes
--   (the old counts no longer apply; fixed-window is not exact across its edges anyway).
--
-- KEYS[1]  the seller's limiter state for ALGORITHM
-- KEYS[2]  the seller's limit override ("COUNT WINDOW_US"), may be absent
-- KEYS[3]  the seller's pause ("UNTIL_US"), may be absent
-- KEYS[4]  the seller's reserved slots (sorted set: member = TOKEN, score = slot)
-- ARGV[1]  ALGORITHM: sliding-window, gcra, token-bucket or fixed-window
-- ARGV[2]  default COUNT (integer >= 1)
-- ARGV[3]  default WINDOW in µs (integer >= 1)
-- ARGV[4]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- ARGV[5]  gcra: BURST (integer >= 1); others: ignored
-- ARGV[6]  token-bucket: CAPACITY (integer >= 0; 0 = COUNT); others: ignored
-- ARGV[7]  CHANGE: `set` (the override becomes ARGV[8]), `clear` (the override is removed),
--          `resume` (the pause is lifted) or `release` (nothing but the give-back)
-- ARGV[8]  with `set`: the new override "COUNT WINDOW_US" (integers >= 1)
-- Returns {CHANGED, RELEASED, NOW_US}: CHANGED is 1 when there was an override to clear or a
-- pause to lift (always 1 for set and release); RELEASED is how many reservations were given back.

local algorithm = algorithm_arg(1)
local count, window = effective_limit(KEYS[2], int_arg(2, 1), int_arg(3, 1))
local guard = guard_for(window, int_arg(4, -1))
local burst = math.min(int_arg(5, 1), count)
local capacity = int_arg(6, 0)
if capacity == 0 then capacity = count end
local change = ARGV[7]
-- The limit that applies after the change.
local new_count, new_window = count, window
if change == 'set' then
  local c, w = string.match(ARGV[8] or '', '^(%d+) (%d+)$')
  new_count, new_window = tonumber(c), tonumber(w)
  if not c or new_count < 1 or new_window < 1 then
    error({err = 'ERR turnstile: the new limit must be "COUNT WINDOW_US" with integers >= 1'})
  end
elseif change == 'clear' then
  new_count, new_window = int_arg(2, 1), int_arg(3, 1)
elseif change ~= 'resume' and change ~= 'release' then
  error({err = 'ERR turnstile: CHANGE must be set, clear, resume or release'})
end
local now = now_us()

local reserved = redis.call('ZRANGE', KEYS[4], 0, -1, 'WITHSCORES')
local released = #reserved / 2
if algorithm == 'gcra' then
  local tat = tonumber(redis.call('GET', KEYS[1]) or '')
  if tat ~= nil then
    -- Only slots after every call made so far (later than the earliest a grant may be) are the
    -- end of the schedule; an older, unredeemed one stays unused.
    local ahead = redis.call('ZCOUNT', KEYS[4], string.format('(%.0f', now + math.floor(guard / 10)), '+inf')
    local interval = (window + guard) / (count - burst + 1)
    -- A grant is only made with its slot at most GUARD/10 ahead, so the calls' TAT is at most
    -- BURST intervals past that (a pause folded into the TAT ends there too).
    local calls_tat = math.min(tat - ahead * interval, now + math.floor(guard / 10) + burst * interval)
    local cells = math.max(calls_tat - now, 0) / interval
    -- The calls' cells, spaced at the new interval, never more than one new window ahead.
    local new_guard = guard_for(new_window, int_arg(4, -1))
    local new_burst = math.min(int_arg(5, 1), new_count)
    local new_interval = (new_window + new_guard) / (new_count - new_burst + 1)
    local ahead_us = math.min(cells * new_interval, new_window + new_guard)
    if ahead_us > 0 then
      redis.call('SET', KEYS[1], string.format('%.0f', now + ahead_us), 'PX', math.floor(ahead_us / 1000) + 1)
    else
      redis.call('DEL', KEYS[1])
    end
  end
elseif algorithm == 'token-bucket' then
  local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local tokens, ts = tonumber(state[1]), tonumber(state[2])
  if tokens ~= nil and ts ~= nil then
    -- The bucket now, with the reserved tokens back. Only reservations run into debt (a grant
    -- needs the tokens at its slot, at most GUARD/10 ahead), so once they are all given back
    -- the bucket now holds at least nothing; a pause folded into TS is dropped the same way.
    local filled = tokens + (now - ts) * count / (window + guard) + released
    filled = math.min(math.max(filled, 0), capacity)
    redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', filled), 'ts', string.format('%.0f', now))
  end
else
  for i = 1, #reserved, 2 do
    give_back(algorithm, KEYS[1], reserved[i], tonumber(reserved[i + 1]), window, capacity)
  end
  -- The windows are looked at again from now: a new COUNT may leave room in a full one.
  if algorithm == 'fixed-window' then redis.call('HDEL', KEYS[1], 'next') end
end
redis.call('DEL', KEYS[4])

local changed = 1
if change == 'set' then
  redis.call('SET', KEYS[2], ARGV[8])
elseif change == 'clear' then
  changed = redis.call('DEL', KEYS[2])
elseif change == 'resume' then
  changed = redis.call('DEL', KEYS[3])
end
return {changed, released, now}

-- reschedule: changes the terms of a seller (sets or clears its limit override, lifts its
-- pause) and, in the same atomic step, gives back every slot reserved under the old terms, so
-- that the new terms apply at once to the seller's whole backlog: the holders of those
-- reservations find them gone when they come back (redeem answers 8) and reserve anew, and
-- slots are computed afresh from what was really granted.
--   sliding-window  every reserved unit leaves the log: exact;
--   fixed-window    every reserved slot's units leave its windows' counters: exact;
--   token-bucket    the buckets are brought to now, every reserved unit goes back into each
--                   (between 0 and its capacity: only reservations run into debt);
--   gcra            each limit's TAT moves back by one emission interval per reserved unit
--                   whose slot lies after every call made (later than GUARD/10 from now): those
--                   are the end of the schedule (a grant is only made when no slot lies ahead),
--                   so what is left is the schedule of the calls, at most BURST intervals past
--                   the latest a grant may be (a pause folded into the TAT ends there); the most
--                   cells any limit still holds are then spaced at each new limit's interval, at
--                   most one new window ahead (by then every earlier call has left any window).
--   fixed-window counters are kept per window index: a new WINDOW length starts new indexes
--   (the old counts no longer apply; fixed-window is not exact across its edges anyway).
--
-- KEYS[1]  the seller's limiter state for ALGORITHM
-- KEYS[2]  the seller's limit override ("COUNTS WINDOWS_US"), may be absent
-- KEYS[3]  the seller's pause ("UNTIL_US"), may be absent
-- KEYS[4]  the seller's reserved slots (sorted set: member = held_name(TOKEN, COST), score = slot)
-- ARGV[1]  ALGORITHM: sliding-window, gcra, token-bucket or fixed-window
-- ARGV[2]  default COUNTS, comma-separated (integers >= 1; 1 to 8 limits)
-- ARGV[3]  default WINDOWS in µs, comma-separated, one per count (integers >= 1)
-- ARGV[4]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- ARGV[5]  gcra: BURST (integer >= 1); others: ignored
-- ARGV[6]  token-bucket: CAPACITY (integer >= 0; see with_capacities); others: ignored
-- ARGV[7]  CHANGE: `set` (the override becomes ARGV[8]), `clear` (the override is removed),
--          `resume` (the pause is lifted) or `release` (nothing but the give-back)
-- ARGV[8]  with `set`: the new override "COUNTS WINDOWS_US" (as parse_limits takes them)
-- Returns {CHANGED, RELEASED, NOW_US}: CHANGED is 1 when there was an override to clear or a
-- pause to lift (always 1 for set and release); RELEASED is how many reservations were given back.

local algorithm = algorithm_arg(1)
local guard = int_arg(4, -1)
local burst = int_arg(5, 1)
local capacity = int_arg(6, 0)
local limits = with_capacities(with_spans(effective_limits(KEYS[2], limits_arg(2)), guard), capacity)
local change = ARGV[7]
-- The stack that applies after the change.
local new_limits = limits
if change == 'set' then
  new_limits = parse_limits(string.match(ARGV[8] or '', '^([%d,]+) ([%d,]+)$'))
  if new_limits == nil then
    error({err = 'ERR turnstile: the new limit must be "COUNTS WINDOWS_US": 1 to ' .. MAX_STACK ..
      ' integers >= 1 each, comma-separated'})
  end
  with_spans(new_limits, guard)
elseif change == 'clear' then
  new_limits = with_spans(limits_arg(2), guard)
elseif change ~= 'resume' and change ~= 'release' then
  error({err = 'ERR turnstile: CHANGE must be set, clear, resume or release'})
end
local now = now_us()

local reserved = redis.call('ZRANGE', KEYS[4], 0, -1, 'WITHSCORES')
local released = #reserved / 2
local function units_of(members)
  local units = 0
  for i = 1, #members, 2 do
    local _, cost = held_parts(members[i])
    units = units + cost
  end
  return units
end
if algorithm == 'gcra' then
  local value = redis.call('GET', KEYS[1])
  if value then
    local stored, latest = {}, 0
    for t in string.gmatch(value, '[^,]+') do
      stored[#stored + 1] = tonumber(t) or 0
      latest = math.max(latest, stored[#stored])
    end
    -- Only units slotted after every call made so far (later than the earliest a grant may be)
    -- are the end of the schedule; an older, unredeemed one stays unused.
    local early = math.floor(limits.min_guard / 10)
    local ahead = units_of(redis.call('ZRANGEBYSCORE', KEYS[4], string.format('(%.0f', now + early), '+inf', 'WITHSCORES'))
    local cells = 0
    for i, l in ipairs(limits) do
      local b = math.min(burst, l.count)
      local interval = l.span / (l.count - b + 1)
      -- A grant is only made with its slot at most GUARD/10 ahead, so the calls' TAT is at most
      -- BURST intervals past that (a pause folded into the TAT ends there too).
      local calls_tat = math.min((stored[i] or latest) - ahead * interval, now + early + b * interval)
      cells = math.max(cells, math.max(calls_tat - now, 0) / interval)
    end
    -- The calls' cells, spaced at each new interval, never more than one new window ahead.
    local tats, longest = {}, 0
    for i, l in ipairs(new_limits) do
      local b = math.min(burst, l.count)
      local ahead_us = math.min(cells * l.span / (l.count - b + 1), l.span)
      tats[i] = string.format('%.0f', now + ahead_us)
      longest = math.max(longest, ahead_us)
    end
    if longest > 0 then
      redis.call('SET', KEYS[1], table.concat(tats, ','), 'PX', math.floor(longest / 1000) + 1)
    else
      redis.call('DEL', KEYS[1])
    end
  end
elseif algorithm == 'token-bucket' then
  local fields = {'ts'}
  for i = 1, #limits do fields[i + 1] = tb_field(i) end
  local state = redis.call('HMGET', KEYS[1], unpack(fields))
  local ts = tonumber(state[1])
  if ts ~= nil then
    -- The buckets now, with the reserved units back. Only reservations run into debt (a grant
    -- needs the tokens at its slot, at most GUARD/10 ahead), so once they are all given back
    -- each bucket now holds at least nothing; a pause folded into TS is dropped the same way.
    local units = units_of(reserved)
    local write = {'ts', string.format('%.0f', now)}
    for i, l in ipairs(limits) do
      local tokens = tonumber(state[i + 1])
      if tokens ~= nil then
        local filled = tokens + (now - ts) * l.count / l.span + units
        write[#write + 1] = tb_field(i)
        write[#write + 1] = string.format('%.6f', math.min(math.max(filled, 0), l.capacity))
      end
    end
    redis.call('HSET', KEYS[1], unpack(write))
  end
else
  for i = 1, #reserved, 2 do
    local token, cost = held_parts(reserved[i])
    give_back(algorithm, KEYS[1], token, cost, tonumber(reserved[i + 1]), limits)
  end
  -- The windows are looked at again from now: a new COUNT may leave room in a full one.
  if algorithm == 'fixed-window' then
    for i, l in ipairs(limits) do redis.call('HDEL', KEYS[1], fw_next(i, l)) end
  end
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

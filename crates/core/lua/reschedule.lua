-- @include args
-- @include blocks
-- @include limits
-- @include states
-- @include terms
-- @include terms_change
-- @include time
-- reschedule: changes the terms of a seller (sets or clears its limit override, lifts its
-- pause) and, in the same atomic step, gives back every slot reserved under the old terms, so
-- that the new terms apply at once to the seller's whole backlog: the holders of those
-- reservations find them gone when they come back (redeem answers 8) and reserve anew, and
-- slots are computed afresh from what was really granted (see give_back_reserved in
-- include/terms_change.lua).
-- With sliding-window, the units of the seller's pool no call claimed yet (permit blocks, taken
-- under the old terms) are taken back in the same step (see reclaim_idle).
--
-- KEYS[1]  the seller's limiter state for ALGORITHM
-- KEYS[2]  the seller's limit override ("COUNTS WINDOWS_US"), may be absent
-- KEYS[3]  the seller's pause ("UNTIL_US"), may be absent
-- KEYS[4]  the seller's reserved slots (sorted set: member = held_name(TOKEN, COST), score = slot)
-- KEYS[5]  sliding-window: the seller's pool of unclaimed permit-block units (see take_block)
-- KEYS[6]  sliding-window: the seller's calls (see calls_gate)
-- KEYS[-n] with ROUTES = n: the seller's logs of the routes, the last n keys (see
--          include/routes.lua): a reservation on a route leaves its route's log too
-- KEYS[5]  (KEYS[7] with sliding-window) optional (adaptive limits on): the seller's learned
--          state (see with_learned)
-- ARGV[1]  ALGORITHM: sliding-window, gcra, token-bucket or fixed-window
-- ARGV[2]  default COUNTS, comma-separated (integers >= 1; 1 to 8 limits)
-- ARGV[3]  default WINDOWS in µs, comma-separated, one per count (integers >= 1)
-- ARGV[4]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- ARGV[5]  gcra: BURST (integer >= 1); others: ignored
-- ARGV[6]  token-bucket: CAPACITY (integer >= 0; see with_capacities); others: ignored
-- ARGV[7]  CHANGE: `set` (the override becomes ARGV[8]), `clear` (the override is removed),
--          `resume` (the pause is lifted) or `release` (nothing but the give-back)
-- ARGV[8]  with `set`: the new override "COUNTS WINDOWS_US" (as parse_limits takes them); else
--          ignored ('' when ARGV[9] follows)
-- ARGV[9]  optional ROUTES: how many of the last keys are the seller's logs of the routes
--          (integer >= 0; absent = 0)
-- Returns {CHANGED, RELEASED, NOW_US}: CHANGED is 1 when there was an override to clear or a
-- pause to lift (always 1 for set and release); RELEASED is how many reservations were given back.

local algorithm = algorithm_arg(1)
local routes = 0
if ARGV[9] ~= nil then routes = int_arg(9, 0) end
local route_logs = {}
for i = #KEYS - routes + 1, #KEYS do route_logs[#route_logs + 1] = KEYS[i] end
-- The script's own keys come first; the routes' logs, if any, last.
local own = #KEYS - routes
local function own_key(i)
  if i <= own then return KEYS[i] end
  return nil
end
local pool_key, calls_key, learned_key = nil, nil, own_key(5)
if algorithm == 'sliding-window' then
  pool_key, calls_key, learned_key = KEYS[5], KEYS[6], own_key(7)
  if pool_key == nil or calls_key == nil then
    error({err = 'ERR turnstile: sliding-window needs KEYS[5] and KEYS[6]'})
  end
end
local guard = int_arg(4, -1)
local burst = int_arg(5, 1)
local capacity = int_arg(6, 0)
local limits = with_capacities(with_spans(effective_limits(KEYS[2], limits_arg(2), learned_key), guard), capacity)
local change = ARGV[7]
-- The stack that applies after the change.
local new_limits = limits
if change == 'set' then
  new_limits = parse_limits(string.match(ARGV[8] or '', '^([%d,]+) ([%d,@]+)$'))
  if new_limits == nil then
    error({err = 'ERR turnstile: the new limit must be "COUNTS WINDOWS_US": 1 to ' .. MAX_STACK ..
      ' integers >= 1 each, comma-separated'})
  end
  for _, l in ipairs(new_limits) do
    if l.phase ~= nil and algorithm ~= 'sliding-window' then
      error({err = 'ERR turnstile: a calendar limit (COUNT/1d@...) needs sliding-window'})
    end
  end
elseif change == 'clear' then
  new_limits = limits_arg(2)
elseif change ~= 'resume' and change ~= 'release' then
  error({err = 'ERR turnstile: CHANGE must be set, clear, resume or release'})
end
if new_limits ~= limits then
  -- What was learned under the new terms, if anything, applies to them.
  if learned_key then new_limits = with_learned(learned_key, new_limits, 1) end
  with_spans(new_limits, guard)
end
local now = now_us()

local released = give_back_reserved(algorithm, KEYS[1], KEYS[4], limits, new_limits, now, burst,
  route_logs)
reclaim_idle(pool_key, KEYS[1], calls_key)

local changed = 1
if change == 'set' then
  redis.call('SET', KEYS[2], ARGV[8])
elseif change == 'clear' then
  changed = redis.call('DEL', KEYS[2])
elseif change == 'resume' then
  changed = redis.call('DEL', KEYS[3])
end
return {changed, released, now}

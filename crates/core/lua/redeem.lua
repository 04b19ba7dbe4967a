-- @include args
-- @include calendar
-- @include calls
-- @include limits
-- @include losses
-- @include pauses
-- @include records
-- @include reservations
-- @include routes
-- @include shadow
-- @include states
-- @include terms
-- @include time
-- redeem: a caller comes back for the slot it reserved. The reservation is bound to its TOKEN
-- and COST and is good once: it must still be in the seller's reserved set at its SLOT, and any
-- answer but "early" consumes it. Granted if the slot is due (at most GUARD/10 ahead, and not
-- later than the algorithm's lateness allows, see include/reservations.lua), the seller is not
-- paused past it, and the stack of limits it was reserved under still applies or is stricter
-- than the one that applies (a learned limit raised since, see within in include/limits.lua).
-- A forfeited slot is given back to the seller's state in the same step (see give_back in
-- include/states.lua), so the next caller may take it.
--
-- KEYS[1]  the seller's limit override ("COUNTS WINDOWS_US"), may be absent
-- KEYS[2]  the seller's pause ("UNTIL_US"), may be absent
-- KEYS[3]  the seller's limiter state for ALGORITHM
-- KEYS[4]  the seller's reserved slots (sorted set: member = held_name(TOKEN, COST), score = slot)
-- KEYS[5]  the seller's server stamp (see check_server in include/losses.lua)
-- KEYS[6]  the seller's calls (sorted set: the units of each TOKEN, score = END; see calls_gate)
-- KEYS[7]  the seller's learned state (see with_learned in include/terms.lua; used with FLAGS +4)
-- KEYS[8]  the seller's shadow limit (see judge_shadow in include/shadow.lua), may be absent
-- KEYS[9]  the seller's shadow log (see judge_shadow)
-- KEYS[10] the loss marker of the seller's hash slot (no TTL; see losses_since in
--          include/losses.lua)
-- KEYS[11] optional: the message's completion record
-- KEYS[-2], KEYS[-1]  with ROUTE: the route's log for the seller and the seller's override of
--          the route's stack (see include/routes.lua); the last two keys
-- ARGV[1]  default COUNTS, comma-separated (integers >= 1; 1 to 8 limits)
-- ARGV[2]  default WINDOWS in µs, comma-separated, one per count (integers >= 1)
-- ARGV[3]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- ARGV[4]  SLOT in µs (Redis time), as returned when it was reserved
-- ARGV[5]  COUNTS the slot was reserved under
-- ARGV[6]  WINDOWS_US the slot was reserved under
-- ARGV[7]  FLAGS: +2 = Redis keeps its data across restarts (no server check); +4 = adaptive
--          limits: the learned counts apply (KEYS[7])
-- ARGV[8]  ALGORITHM: sliding-window, gcra, token-bucket or fixed-window
-- ARGV[9]  TOKEN the slot was reserved with (letters, digits, dashes; at most 64)
-- ARGV[10] token-bucket: CAPACITY (integer >= 0; see with_capacities); others: ignored
-- ARGV[11] BOUND in µs: the latest a granted call's answer (or timeout) comes back after its
--          grant (integer >= 0; sliding-window and gcra track their calls)
-- ARGV[12] COST the slot was reserved for (integer from 1 to 10000)
-- ARGV[13] optional ROUTE: the route's COUNTS (see include/routes.lua): the call waits for the
--          route's calls too, and a forfeited slot's units leave the route's log as well
-- ARGV[14] with ROUTE: the route's WINDOWS in µs
-- Returns {STATUS, AT_US, NOW_US, VERDICT}
--   1 granted; 2 early (or calls of the last window still in flight): come back at AT (the
--   reservation is kept); 3 paused until AT; 4 the limits changed; 5 too late; 6 the message
--   already registered (KEYS[11] says so); 9 moved back to AT by a message ranked ahead of it
--   (the reservation is kept at AT); 8 no such reservation (never made, already redeemed,
--   made for another cost, given back by a limit change or resume, or lost with Redis).
--   3 to 8 leave no reservation: the caller acquires a new one. VERDICT (with 1) is the shadow
--   limit's (see judge_shadow), else ''.

local default = limits_arg(1)
local guard = int_arg(3, -1)
local slot = int_arg(4, 0)
local held = limits_arg(5)
local flags = int_arg(7, 0)
local durable = math.floor(flags / 2) % 2 == 1
local learned_key = nil
if flags >= 4 then learned_key = KEYS[7] end
local algorithm = algorithm_arg(8)
local token = token_arg(9)
local capacity = int_arg(10, 0)
local bound = int_arg(11, 0)
local cost = int_arg(12, 1)
local limits = with_spans(effective_limits(KEYS[1], default, learned_key, cost), guard)
with_capacities(with_spans(held, guard), capacity)
local done_key = KEYS[11]
local route = nil
if ARGV[13] ~= nil then
  if #KEYS < 12 then error({err = 'ERR turnstile: ROUTE needs its two keys last'}) end
  if #KEYS == 12 then done_key = nil end
  route = route_arg(13, KEYS[#KEYS - 1], KEYS[#KEYS], guard, cost)
end
local route_logs = route and {route.log}
local now = now_us()

local name = held_name(token, cost)
local reserved = tonumber(redis.call('ZSCORE', KEYS[4], name))
local function release(status, at)
  if reserved ~= nil then
    redis.call('ZREM', KEYS[4], name)
    -- The slot's units were taken under the stack it was reserved under.
    if status ~= 1 then give_back(algorithm, KEYS[3], token, cost, reserved, held, route_logs) end
  end
  local verdict = ''
  if status == 1 then
    local a = {shadow = KEYS[8], shadow_log = KEYS[9], token = token, cost = cost}
    judge_shadow(a, now, true)
    verdict = a.verdict or ''
  end
  return {status, at, now, verdict}
end

if already_done(done_key) then return release(6, now) end
if reserved == nil or reserved < slot then return {8, now, now, ''} end
-- Moved later by a message ranked ahead of it (see give_way in include/ranks.lua): the
-- reservation is kept at its new slot, which the caller now holds.
if reserved > slot then return {9, reserved, now, ''} end
local span = limits.max_span
if algorithm == 'fixed-window' then span = limits.max_window end
check_server(KEYS[5], KEYS[3], KEYS[2], KEYS[10], span, now, durable)
local pause = paused_until(KEYS[2])
if pause > slot then return release(3, pause) end
if not within(held, limits) then return release(4, now) end
if now < slot - math.floor(limits.min_guard / 10) then return {2, slot, now, ''} end
if now > slot + lateness(algorithm, limits) then return release(5, now) end
-- A calendar limit counts the unit in its slot's window (see calendar_late): a call that could
-- reach the API in another is too late.
local early = math.floor(limits.min_guard / 10)
local function calendar_too_late(stack)
  for _, l in ipairs(stack) do
    if l.phase ~= nil and calendar_late(l, slot, now, bound + early + l.guard) then return true end
  end
  return false
end
if calendar_too_late(limits) or (route and calendar_too_late(route.limits)) then
  return release(5, now)
end
if algorithm == 'sliding-window' or algorithm == 'gcra' then
  local open_at = calls_gate(KEYS[6], now, limits, cost)
  if open_at then return {2, open_at, now, ''} end
  if route then
    open_at = route_gate(route, KEYS[6], token, cost, now, early, bound,
      lateness(algorithm, limits), limits.max_window)
    if open_at then return {2, open_at, now, ''} end
  end
  start_call(KEYS[6], token, cost, now, bound, limits)
end
return release(1, slot)

-- @include acquire
-- @include args
-- @include blocks
-- @include calls
-- @include far
-- @include fit
-- @include limits
-- @include losses
-- @include records
-- @include reservations
-- @include routes
-- @include terms
-- @include time
-- @include units
-- sliding_window: exact sliding log with reservations, for a stack of limits and weighed calls.
-- For every limit of the stack, at most COUNT units lie in any window of WINDOW+GUARD; a unit
-- is part of a past grant or of a future reservation, so a caller told to wait holds its slot and
-- is not denied again. A call of COST units takes COST units at its slot (see unit).
--
-- KEYS[1]  the seller's log (sorted set: the units of each TOKEN, score = slot in µs, Redis time)
-- KEYS[2]  the seller's limit override ("COUNTS WINDOWS_US"), may be absent
-- KEYS[3]  the seller's pause ("UNTIL_US"), may be absent
-- KEYS[4]  the seller's reserved slots (sorted set: member = held_name(TOKEN, COST), score = slot)
-- KEYS[5]  the seller's server stamp (run id of the Redis that wrote its state; see check_server in
--          include/losses.lua)
-- KEYS[6]  the seller's calls (sorted set: the units of each TOKEN, score = END; see calls_gate)
-- KEYS[7]  the seller's far queue (hash: at, n; see far_ticket in include/far.lua)
-- KEYS[8]  the seller's learned state (see with_learned in include/terms.lua; used with FLAGS +4)
-- KEYS[9]  the seller's shadow limit (see judge_shadow in include/shadow.lua), may be absent
-- KEYS[10] the seller's shadow log (see judge_shadow)
-- KEYS[11] the loss marker of the seller's hash slot (no TTL; see losses_since in
--          include/losses.lua)
-- KEYS[12] the seller's give-way budget (string: until when its steps are spent; see give_way in
--          include/ranks.lua)
-- KEYS[13] the seller's pool of unclaimed permit-block units (see take_block, claim_idle and
--          reclaim_idle in include/blocks.lua): with BLOCK given, a unit of it is claimed before
--          anything else is decided; reclaimed when the call would otherwise wait
-- KEYS[14] optional: the message's completion record; if it exists nothing is written
-- KEYS[-2], KEYS[-1]  with ROUTE: the route's log for the seller and the seller's override of
--          the route's stack (see include/routes.lua); the last two keys
-- ARGV[1]  default COUNTS: the stack's counts, comma-separated (integers >= 1; 1 to 8 limits)
-- ARGV[2]  default WINDOWS in µs, comma-separated, one per count (integers >= 1)
-- ARGV[3]  GUARD in µs added to each window (-1 = window/20 within [25 ms, 2 s])
-- ARGV[4]  FLAGS: +1 = reserve a future slot for a caller who must wait (else only answer);
--          +2 = Redis keeps its data across restarts (no cold-start wait, see
--          check_server in include/losses.lua);
--          +4 = adaptive limits: the learned counts and the downstream's quota apply (KEYS[8])
-- ARGV[5]  HORIZON in µs: a slot further away than this is never reserved
-- ARGV[6]  TOKEN: a string unique to this attempt (letters, digits, dashes; at most 64)
-- ARGV[7]  BOUND in µs: the latest a granted call's answer (or timeout) comes back after its
--          grant (integer >= 0)
-- ARGV[8]  COST: units of every limit the call takes (integer from 1 to 10000)
-- ARGV[9]  optional BLOCK: the caller takes part in permit blocks. A call of one unit, not
--          paused, under no learned limit or quota, is first granted a unit of the seller's pool
--          if it holds one (claim_idle); else, with a grant, up to BLOCK more units go into the
--          pool for the seller's next calls (integer 0 to 64; 0 = none; see take_block)
-- ARGV[10] with BLOCK: HOLD in µs, how long after the grant those units may be claimed
-- ARGV[11] optional ROUTE: the route's COUNTS (with BLOCK given; see include/routes.lua): the
--          call also takes COST units of the route's stack, in the same step, at the same slot;
--          it never claims or takes permit-block units, and its TOKEN ends with `-q`
-- ARGV[12] with ROUTE: the route's WINDOWS in µs
-- Returns {STATUS, SLOT_US, NOW_US, COUNTS, WINDOWS_US, USED_PERMILLE, VERDICT, BLOCKED, CALL,
--          ENDS_US, STALE}
--   STATUS 1 = granted (call now), 2 = reserved (call at SLOT), 0 = denied (come back at SLOT;
--   with reserving on, when the seller's reserved set is full: see far_ticket),
--   3 = the message already registered (KEYS[14] says so),
--   4 = COST exceeds the smallest COUNT of the stack (or of the route's): never granted
--   (SLOT_US is that COUNT);
--   USED_PERMILLE (with STATUS 1) is how much of the limit is taken after this grant, in
--   thousandths (units in the window / COUNT, the most taken limit of the stack): the
--   near-limit metric; COUNTS and WINDOWS_US are the stack that applied (override or default).
--   VERDICT (STATUS 0, 1, 2) is the shadow limit's: agree, stricter, looser or '' (see judge_shadow);
--   COUNTS and WINDOWS_US are the learned ones when adaptive limits lowered them.
--   BLOCKED (STATUS 1): how many block units were taken, named TOKEN-2 ... TOKEN-(BLOCKED+1).
--   CALL (STATUS 1, with BLOCK): '' when the call is TOKEN, else the pool's unit that was
--   claimed for it (ENDS_US: its END in the calls; USED_PERMILLE is then 0: a block is only
--   granted with at most half of every limit used). STALE: units of the pool whose hold was
--   over, given back.

local a = acquire_args('sliding-window')
-- This script takes the seller's permit-block units before the completion record, and a
-- route's two keys last.
local blocked_key
blocked_key, a.done = KEYS[13], KEYS[14]
local route_keys = 0
if ARGV[11] ~= nil then
  route_keys = 2
  if #KEYS < 15 then error({err = 'ERR turnstile: ROUTE needs its two keys last'}) end
  if #KEYS == 15 then a.done = nil end
  if not routed(a.token) then error({err = 'ERR turnstile: a route\'s TOKEN ends with -q'}) end
end
local block, hold, pooled = 0, 0, ARGV[9] ~= nil
if pooled then
  block = int_arg(9, 0)
  if block > MAX_BLOCK then error({err = 'ERR turnstile: BLOCK must be at most ' .. MAX_BLOCK}) end
  hold = int_arg(10, 0)
  if hold > MAX_HOLD_US then error({err = 'ERR turnstile: HOLD must be at most 60 s'}) end
  if blocked_key == nil then error({err = 'ERR turnstile: BLOCK needs KEYS[13]'}) end
end
local limits = with_spans(effective_limits(KEYS[2], a.limits, a.learned, a.cost), a.guard)
local route = nil
if route_keys > 0 then
  route = route_arg(11, KEYS[#KEYS - 1], KEYS[#KEYS], a.guard, a.cost)
  pooled, block = false, 0
end
local now = now_us()
if already_done(a.done) then return {3, now, now, limits.counts, limits.windows} end
if a.cost > limits.min_count then return never(limits.min_count, now, limits) end
if route and a.cost > route.limits.min_count then return never(route.limits.min_count, now, limits) end
-- On a server that did not write the seller's state, a pool it holds may have been restored
-- with units claimed since (lost writes): it is dropped, its units stay counted until they end.
if check_server(KEYS[5], KEYS[1], KEYS[3], a.losses, limits.max_span, now, a.durable) and blocked_key then
  redis.call('DEL', blocked_key)
end

local earliest = math.max(now, not_before(KEYS[3], limits, a.cost, now))
local stale = 0
if pooled and a.cost == 1 and earliest == now and limits.configured == nil
  and limits.quota_until == nil then
  local unit, ends
  unit, ends, stale = claim_idle(blocked_key, KEYS[1], KEYS[6], now, a.bound)
  if unit ~= nil then
    return {1, now, now, limits.counts, limits.windows, 0, '', 0, unit,
      string.format('%.0f', ends), stale}
  end
end
-- A calendar limit counts units slotted up to ZONE (+ its guard) before its window's start: a
-- call granted then may reach the API after it (see include/calendar.lua).
local early = math.floor(limits.min_guard / 10)
local zone = a.bound + early
local calendars = limits.has_calendar or (route ~= nil and route.limits.has_calendar)
local kept = limits.max_span
if limits.has_calendar then kept = kept + zone end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - kept)
local late = lateness('sliding-window', limits)
if route then route_trim(route, now, a.bound, late) end
-- The slot the log allows for COST more units, and how much of the limit it leaves taken.
-- From FROM: each limit's earliest slot from the latest so far, until they all agree (a
-- sliding limit's slots are a threshold, any later one fits too; a calendar limit's may move a
-- slot to a later window, which the others then check again).
local function fit(from)
  local slot, used = from, 0
  for _ = 1, 16 do
    local before = slot
    local pushed
    slot, used, pushed = stack_fit(KEYS[1], limits, slot, now, a.cost, zone, early)
    -- A call takes room the seller's log left before its last slot (gap_fit): a call on a
    -- route, whose own route may be free, and any call the log's last slot alone pushes back
    -- (a slot reserved far ahead under slower terms holds back no caller under the new ones).
    if (route or pushed) and not limits.has_calendar then
      slot = gap_fit(KEYS[1], limits, before, slot, a.cost)
    end
    if route then slot = route_fit(route, slot, now, a.cost, zone, early) end
    -- Sliding limits alone agree after one pass (each slot is a threshold).
    if slot == before or not (calendars or route) then break end
  end
  return slot, used
end
-- The route's calls too (see route_gate): a call due now waits for their answers as for the
-- seller's.
local function after_gates(status, slot)
  slot, status = after_gate(status, slot, KEYS[6], now, limits, a)
  if route == nil or status ~= 1 then return slot, status end
  local open_at = route_gate(route, KEYS[6], a.token, a.cost, now, early, a.bound, late,
    limits.max_window)
  if not open_at then return slot, status end
  return math.max(open_at, slot), (a.reserve == 1 and 2 or 0)
end
-- Fits, then waits for the calls in flight; a slot the calls moved later is fitted again (a
-- calendar limit may not take it there).
local function decide()
  local slot, used = fit(earliest)
  local status = due(slot, now, limits.min_guard, a)
  -- Due, but calls of the last window may still be in flight: wait for their answers.
  slot, status = after_gates(status, slot)
  if calendars and status ~= 1 then
    local refit = fit(slot)
    if refit ~= slot then slot, status = refit, due(refit, now, limits.min_guard, a) end
  end
  return slot, used, status
end
local slot, used, status = decide()
-- Not due while other replicas hold units of the seller they have not used: taken back.
if status ~= 1 and reclaim_idle(blocked_key, KEYS[1], KEYS[6]) > 0 then
  slot, used, status = decide()
end
status, slot = slot_or_far_ticket(status, slot, KEYS[4], KEYS[7], now, late, limits, a,
  log_crowded(KEYS[1], limits, a.cost))
if status == 0 then return told_to_wait(0, slot, now, limits, a) end
add_units(KEYS[1], slot, a.token, a.cost)
local last = tonumber(redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2])
local ttl = math.floor((last - now + kept) / 1000) + 1
redis.call('PEXPIRE', KEYS[1], ttl)
if route then route_add(route, slot, a.token, a.cost, now, a.bound, late) end
local waiting = keep_and_hold(status, ttl, KEYS[5], KEYS[4], slot, now, late, a, limits)
if waiting then return waiting end
start_call(KEYS[6], a.token, a.cost, now, a.bound, limits)
local blocked = 0
if status == 1 then
  blocked = take_block(a, limits, KEYS[1], KEYS[4], KEYS[6], blocked_key, now, block, hold)
end
return {status, slot, now, limits.counts, limits.windows, used, a.verdict or '', blocked, '', 0, stale}

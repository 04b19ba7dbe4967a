-- @include acquire
-- @include far
-- @include limits
-- @include losses
-- @include records
-- @include reservations
-- @include states
-- @include terms
-- @include time
-- fixed_window: the classic counter per window of WINDOW µs aligned to Redis time, one per limit
-- of the seller's stack, with reservations in later windows. A call of COST units takes the
-- first moment at which the window of every limit has room for COST more. Not exact over a
-- sliding window: up to 2*COUNT units can fall within one WINDOW across a window edge. GUARD is
-- not added (windows stay aligned); it only sets how early a due slot may be granted.
--
-- KEYS[1]  the seller's counters (hash, per limit: WINDOW_US:INDEX -> units taken in window
--          INDEX, WINDOW_US:next = the first window that may still have room; see fw_field in
--          include/states.lua)
-- KEYS[2]  the seller's limit override ("COUNTS WINDOWS_US"), may be absent
-- KEYS[3]  the seller's pause ("UNTIL_US"), may be absent
-- KEYS[4]  the seller's reserved slots (sorted set: member = held_name(TOKEN, COST), score = slot)
-- KEYS[5]  the seller's server stamp (run id of the Redis that wrote its state; see check_server in
--          include/losses.lua)
-- KEYS[6]  the seller's calls (unused: this algorithm is not exact, see docs/algorithms.md)
-- KEYS[7]  the seller's far queue (hash: at, n; see far_ticket in include/far.lua)
-- KEYS[8]  the seller's learned state (see with_learned in include/terms.lua; used with FLAGS +4)
-- KEYS[9]  the seller's shadow limit (see judge_shadow in include/shadow.lua), may be absent
-- KEYS[10] the seller's shadow log (see judge_shadow)
-- KEYS[11] the loss marker of the seller's hash slot (no TTL; see losses_since in
--          include/losses.lua)
-- KEYS[12] the seller's give-way budget (string: until when its steps are spent; see give_way in
--          include/ranks.lua)
-- KEYS[13] optional: the message's completion record; if it exists nothing is written
-- ARGV[1]  default COUNTS: the stack's counts, comma-separated (integers >= 1; 1 to 8 limits)
-- ARGV[2]  default WINDOWS in µs, comma-separated, one per count (integers >= 1)
-- ARGV[3]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- ARGV[4]  FLAGS: +1 = reserve a future slot for a caller who must wait (else only answer);
--          +2 = Redis keeps its data across restarts (no cold-start wait, see
--          check_server in include/losses.lua);
--          +4 = adaptive limits: the learned counts and the downstream's quota apply (KEYS[8])
-- ARGV[5]  HORIZON in µs: a slot further away than this is never reserved
-- ARGV[6]  TOKEN: a string unique to this attempt (letters, digits, dashes; at most 64)
-- ARGV[7]  BOUND (unused: calls are not tracked)
-- ARGV[8]  COST: units of every limit the call takes (integer from 1 to 10000)
-- Returns {STATUS, SLOT_US, NOW_US, COUNTS, WINDOWS_US, USED_PERMILLE, VERDICT}
--   STATUS 1 = granted (call now), 2 = reserved (call at SLOT), 0 = denied (come back at SLOT;
--   with reserving on, when the seller's reserved set is full: see far_ticket),
--   3 = the message already registered (KEYS[13] says so),
--   4 = COST exceeds the smallest COUNT of the stack: never granted (SLOT_US is that COUNT);
--   USED_PERMILLE (with STATUS 1) is how much of the limit is taken after this grant, in
--   thousandths (units of the slot's window / COUNT, the fullest limit): the near-limit metric.
--   VERDICT (STATUS 0, 1, 2) is the shadow limit's: agree, stricter, looser or '' (see judge_shadow);
--   COUNTS and WINDOWS_US are the learned ones when adaptive limits lowered them.

local a = acquire_args('fixed-window')
local limits = with_spans(effective_limits(KEYS[2], a.limits, a.learned, a.cost), a.guard)
local now = now_us()
if already_done(a.done) then return {3, now, now, limits.counts, limits.windows} end
if a.cost > limits.min_count then return never(limits.min_count, now, limits) end
check_server(KEYS[5], KEYS[1], KEYS[3], a.losses, limits.max_window, now, a.durable)

local function taken(l, index)
  return tonumber(redis.call('HGET', KEYS[1], fw_field(l, index)) or '0')
end
-- The first moment from `at` on when every limit's window has room for COST more. Each limit's
-- windows from its `next` on fill in order, so this walks only over windows filled meanwhile;
-- a limit that moves the slot to a later window makes the others look again from there.
local slot = math.max(now, not_before(KEYS[3], limits, a.cost, now))
for _, l in ipairs(limits) do
  l.next = tonumber(redis.call('HGET', KEYS[1], fw_next(l)) or '0')
end
local moved = true
while moved do
  moved = false
  for _, l in ipairs(limits) do
    local index = math.max(math.floor(slot / l.window), l.next)
    while taken(l, index) + a.cost > l.count do index = index + 1 end
    if index * l.window > slot then
      slot = index * l.window
      moved = true
    end
    l.index = index
  end
end

local status = due(slot, now, limits.min_guard, a)
local late = lateness('fixed-window', limits)
status, slot = slot_or_far_ticket(status, slot, KEYS[4], KEYS[7], now, late, limits, a)
if status == 0 then return told_to_wait(0, slot, now, limits, a) end
local last_end, used = 0, 0
for _, l in ipairs(limits) do
  local units = redis.call('HINCRBY', KEYS[1], fw_field(l, l.index), a.cost)
  used = math.max(used, math.floor(units * 1000 / l.count))
  -- `next` moves past the windows that are full now.
  local next_index = math.max(l.next, math.floor(now / l.window))
  while taken(l, next_index) >= l.count do next_index = next_index + 1 end
  redis.call('HSET', KEYS[1], fw_next(l), string.format('%.0f', next_index))
  last_end = math.max(last_end, math.max(next_index, l.index + 1) * l.window)
end
-- Windows already over are forgotten (of every limit the fields name, in the stack or not).
for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
  local w, index = string.match(field, '^(%d+):(%d+)$')
  if index and tonumber(index) < math.floor(now / tonumber(w)) then redis.call('HDEL', KEYS[1], field) end
end
local ttl = math.floor((last_end - now) / 1000) + 1
redis.call('PEXPIRE', KEYS[1], ttl)
local waiting = keep_and_hold(status, ttl, KEYS[5], KEYS[4], slot, now, late, a, limits)
if waiting then return waiting end
return {status, slot, now, limits.counts, limits.windows, used, a.verdict or ''}

-- @include acquire
-- @include args
-- @include far
-- @include limits
-- @include losses
-- @include records
-- @include reservations
-- @include states
-- @include terms
-- @include time
-- token_bucket: per limit of the seller's stack, refill RATE = COUNT per WINDOW+GUARD into a
-- bucket of CAPACITY tokens (see with_capacities); each call takes COST tokens from every bucket
-- (as `requested` in Spring Cloud Gateway's script), at the first moment all of them hold that
-- many. Reserving lets the buckets go into debt, which schedules callers one after another
-- instead of denying them in a loop. Not exact over a sliding window: a full bucket plus its
-- refill allows up to CAPACITY + COUNT units within one window.
--
-- KEYS[1]  the seller's buckets (hash: tokens, tokens2, ... one per limit of the stack; ts = µs
--          at which they hold)
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
-- ARGV[3]  GUARD in µs added to each window (-1 = window/20 within [25 ms, 2 s])
-- ARGV[4]  FLAGS: +1 = reserve a future slot for a caller who must wait (else only answer);
--          +2 = Redis keeps its data across restarts (no cold-start wait, see
--          check_server in include/losses.lua);
--          +4 = adaptive limits: the learned counts and the downstream's quota apply (KEYS[8])
-- ARGV[5]  HORIZON in µs: a slot further away than this is never reserved
-- ARGV[6]  TOKEN: a string unique to this attempt (letters, digits, dashes; at most 64)
-- ARGV[7]  BOUND (unused: calls are not tracked)
-- ARGV[8]  COST: tokens the call takes from every bucket (integer from 1 to 10000)
-- ARGV[9]  CAPACITY of a single limit's bucket (integer >= 0; 0 = COUNT; a stack's buckets hold
--          their COUNT)
-- Returns {STATUS, SLOT_US, NOW_US, COUNTS, WINDOWS_US, USED_PERMILLE, VERDICT}
--   STATUS 1 = granted (call now), 2 = reserved (call at SLOT), 0 = denied (come back at SLOT;
--   with reserving on, when the seller's reserved set is full: see far_ticket),
--   3 = the message already registered (KEYS[13] says so),
--   4 = COST exceeds the smallest capacity: never granted (SLOT_US is that capacity);
--   USED_PERMILLE (with STATUS 1) is how much of the limit is taken after this grant, in
--   thousandths (tokens taken / CAPACITY, the emptiest bucket): the near-limit metric.
--   VERDICT (STATUS 0, 1, 2) is the shadow limit's: agree, stricter, looser or '' (see judge_shadow);
--   COUNTS and WINDOWS_US are the learned ones when adaptive limits lowered them.

local a = acquire_args('token-bucket')
local limits = with_spans(effective_limits(KEYS[2], a.limits, a.learned, a.cost), a.guard)
with_capacities(limits, int_arg(9, 0))
local max_cost = nil
for _, l in ipairs(limits) do max_cost = math.min(max_cost or l.capacity, l.capacity) end
local now = now_us()
if already_done(a.done) then return {3, now, now, limits.counts, limits.windows} end
if a.cost > max_cost then return never(max_cost, now, limits) end
check_server(KEYS[5], KEYS[1], KEYS[3], a.losses, limits.max_span, now, a.durable)

local fields = {'ts'}
for i = 1, #limits do fields[i + 1] = tb_field(i) end
local state = redis.call('HMGET', KEYS[1], unpack(fields))
local ts = tonumber(state[1]) or now
local at = math.max(now, not_before(KEYS[3], limits, a.cost, now))
local slot = at
for i, l in ipairs(limits) do
  l.rate = l.count / l.span -- tokens per µs
  -- Tokens at `at`: refill since ts (before ts the debt is larger still), capped at capacity.
  l.filled = math.min((tonumber(state[i + 1]) or l.capacity) + (at - ts) * l.rate, l.capacity)
  if l.filled < a.cost then slot = math.max(slot, math.ceil(at + (a.cost - l.filled) / l.rate)) end
end

local status = due(slot, now, limits.min_guard, a)
local late = lateness('token-bucket', limits)
status, slot = slot_or_far_ticket(status, slot, KEYS[4], KEYS[7], now, late, limits, a)
if status == 0 then return told_to_wait(0, slot, now, limits, a) end
local write, full_at, used = {'ts', string.format('%.0f', slot)}, slot, 0
for i, l in ipairs(limits) do
  local left = math.min(l.filled + (slot - at) * l.rate, l.capacity) - a.cost
  write[#write + 1] = tb_field(i)
  write[#write + 1] = string.format('%.6f', left)
  full_at = math.max(full_at, slot + (l.capacity - left) / l.rate) -- idle from then on
  used = math.max(used, math.floor((l.capacity - left) * 1000 / l.capacity))
end
redis.call('HSET', KEYS[1], unpack(write))
local ttl = math.floor((full_at - now) / 1000) + 1
redis.call('PEXPIRE', KEYS[1], ttl)
local waiting = keep_and_hold(status, ttl, KEYS[5], KEYS[4], slot, now, late, a, limits)
if waiting then return waiting end
return {status, slot, now, limits.counts, limits.windows, used, a.verdict or ''}

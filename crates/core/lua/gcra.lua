-- @include acquire
-- @include args
-- @include calls
-- @include far
-- @include limits
-- @include losses
-- @include records
-- @include reservations
-- @include tats
-- @include terms
-- @include time
-- gcra: generic cell rate algorithm with O(1) state per limit of a seller's stack (its
-- theoretical arrival time). Per limit: emission interval T = (WINDOW+GUARD) / (COUNT - B + 1)
-- with B = min(BURST, COUNT), tolerance (B-1)*T; a call of COST units is COST cells at once
-- (TAT advances COST*T), which conforms only when COST <= B: then no window of WINDOW+GUARD
-- holds more than COUNT units of any limit. A larger cost is never granted (status 4). A slot is
-- the latest that every limit of the stack allows. Reserving advances the TATs; the caller keeps
-- the returned slot, nothing per caller is stored.
--
-- KEYS[1]  the seller's TATs (string: one per limit of the stack, in its order, comma-separated;
--          µs, Redis time; with the stack that wrote them, see include/tats.lua: a state written
--          under another stack is brought to the one that applies, so that a far stricter
--          stack's schedule, a day ahead under 1/1d, holds back no caller once it no longer
--          applies)
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
-- ARGV[7]  BOUND in µs: the latest a granted call's answer (or timeout) comes back after its
--          grant (integer >= 0)
-- ARGV[8]  COST: units of every limit the call takes (integer from 1 to 10000)
-- ARGV[9]  BURST (integer >= 1; each limit's is at most its COUNT)
-- Returns {STATUS, SLOT_US, NOW_US, COUNTS, WINDOWS_US, USED_PERMILLE, VERDICT}
--   STATUS 1 = granted (call now), 2 = reserved (call at SLOT), 0 = denied (come back at SLOT;
--   with reserving on, when the seller's reserved set is full: see far_ticket),
--   3 = the message already registered (KEYS[13] says so),
--   4 = COST exceeds the smallest burst of the stack: never granted (SLOT_US is that burst);
--   USED_PERMILLE (with STATUS 1) is how much of the limit is taken after this grant, in
--   thousandths (TAT ahead of now / B intervals, the most taken limit of the stack): the
--   near-limit metric; COUNTS and WINDOWS_US are the stack that applied.
--   VERDICT (STATUS 0, 1, 2) is the shadow limit's: agree, stricter, looser or '' (see judge_shadow);
--   COUNTS and WINDOWS_US are the learned ones when adaptive limits lowered them.

local a = acquire_args('gcra')
local burst = int_arg(9, 1)
local limits = with_spans(effective_limits(KEYS[2], a.limits, a.learned, a.cost), a.guard)
local max_cost = nil
for _, l in ipairs(limits) do
  l.burst, l.interval = cell_of(l, burst)
  max_cost = math.min(max_cost or l.burst, l.burst)
end
local now = now_us()
if already_done(a.done) then return {3, now, now, limits.counts, limits.windows} end
if a.cost > max_cost then return never(max_cost, now, limits) end
check_server(KEYS[5], KEYS[1], KEYS[3], a.losses, limits.max_span, now, a.durable)

-- The stored TATs under the stack that applies, one per limit; a limit without one (the stack
-- grew) takes the latest stored.
local stored = tats_under(read_tats(redis.call('GET', KEYS[1])), limits, burst, now, KEYS[4])
local slot = math.max(now, not_before(KEYS[3], limits, a.cost, now))
for i, l in ipairs(limits) do
  l.tat = math.max(stored[i] or stored.latest, now)
  slot = math.max(slot, l.tat - (l.burst - a.cost) * l.interval)
end
-- A whole µs, never earlier: the slot is answered, held in the reserved set and redeemed as an
-- integer (an interval such as 5.25 s / 18 is not one).
slot = math.ceil(slot)

local status = due(slot, now, limits.min_guard, a)
local late = lateness('gcra', limits)
-- Due, but calls of the last window may still be in flight: wait for their answers.
slot, status = after_gate(status, slot, KEYS[6], now, limits, a)
status, slot = slot_or_far_ticket(status, slot, KEYS[4], KEYS[7], now, late, limits, a)
if status == 0 then return told_to_wait(0, slot, now, limits, a) end
local tats, ahead, used = {}, 0, 0
for i, l in ipairs(limits) do
  local next_tat = math.max(l.tat, slot) + a.cost * l.interval
  tats[i] = next_tat
  ahead = math.max(ahead, next_tat - now)
  used = math.max(used, math.floor((next_tat - now) * 1000 / (l.burst * l.interval)))
end
local ttl = math.floor(ahead / 1000) + 1
redis.call('SET', KEYS[1], tats_text(tats, limits), 'PX', ttl)
local waiting = keep_and_hold(status, ttl, KEYS[5], KEYS[4], slot, now, late, a, limits)
if waiting then return waiting end
start_call(KEYS[6], a.token, a.cost, now, a.bound, limits)
return {status, slot, now, limits.counts, limits.windows, used, a.verdict or ''}

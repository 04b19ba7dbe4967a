-- sliding_window: exact sliding log with reservations.
-- At most COUNT slots lie in any window of WINDOW+GUARD; a slot is a past grant or a future
-- reservation, so a caller told to wait holds its slot and is not denied again.
--
-- KEYS[1]  the seller's log (sorted set: member = TOKEN, score = slot in µs, Redis time)
-- KEYS[2]  the seller's limit override ("COUNT WINDOW_US"), may be absent
-- KEYS[3]  the seller's pause ("UNTIL_US"), may be absent
-- KEYS[4]  the seller's reserved slots (sorted set: member = TOKEN, score = slot; see the prelude)
-- KEYS[5]  the seller's server stamp (run id of the Redis that wrote its state; see the prelude)
-- KEYS[6]  the seller's calls (sorted set: member = TOKEN, score = END; see calls_gate in the prelude)
-- KEYS[7]  the seller's far queue (hash: at, n; see far_ticket in the prelude)
-- KEYS[8]  optional: the message's completion record; if it exists nothing is written
-- ARGV[1]  default COUNT (integer >= 1)
-- ARGV[2]  default WINDOW in µs (integer >= 1)
-- ARGV[3]  GUARD in µs added to the window (-1 = window/20 within [25 ms, 2 s])
-- ARGV[4]  FLAGS: +1 = reserve a future slot for a caller who must wait (else only answer);
--          +2 = Redis keeps its data across restarts (no cold-start wait, see the prelude)
-- ARGV[5]  HORIZON in µs: a slot further away than this is never reserved
-- ARGV[6]  TOKEN: a string unique to this attempt (letters, digits, dashes; at most 64)
-- ARGV[7]  BOUND in µs: the latest a granted call's answer (or timeout) comes back after its
--          grant (integer >= 0)
-- Returns {STATUS, SLOT_US, NOW_US, COUNT, WINDOW_US, USED_PERMILLE}
--   STATUS 1 = granted (call now), 2 = reserved (call at SLOT), 0 = denied (come back at SLOT;
--   with reserving on, when the seller's reserved set is full: see far_ticket),
--   3 = the message already registered (KEYS[8] says so);
--   USED_PERMILLE (with STATUS 1) is how much of the limit is taken after
--   this grant, in thousandths (slots in the window / COUNT): the near-limit metric;
--   COUNT and WINDOW_US are the limit that applied (override or default).

local a = acquire_args()
local token = a.token
local count, window = effective_limit(KEYS[2], a.count, a.window)
local guard = guard_for(window, a.guard)
local span = window + guard
local now = now_us()
if already_done(KEYS[8]) then return {3, now, now, count, window} end
check_server(KEYS[5], KEYS[1], KEYS[3], span, now, a.durable)

local slot = math.max(now, paused_until(KEYS[3]))
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - span)
local n = redis.call('ZCARD', KEYS[1])
if n >= count then
  -- After the last slot and at least SPAN after the COUNT-th most recent one: then no window
  -- of SPAN containing the new slot holds more than COUNT slots.
  local last = tonumber(redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2])
  local kth = tonumber(redis.call('ZRANGE', KEYS[1], n - count, n - count, 'WITHSCORES')[2])
  slot = math.max(slot, last, kth + span)
end

local status = due(slot, now, guard, a)
local late = lateness('sliding-window', window, guard)
-- Due, but calls of the last window may still be in flight: wait for their answers.
slot, status = after_gate(status, slot, KEYS[6], now, window, count, guard, a.reserve)
status, slot = slot_or_far_ticket(status, slot, KEYS[4], KEYS[7], now, late, span, count)
if status == 0 then return {0, slot, now, count, window} end
redis.call('ZADD', KEYS[1], slot, token)
local last = tonumber(redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2])
local ttl = math.floor((last - now + span) / 1000) + 1
redis.call('PEXPIRE', KEYS[1], ttl)
if keep_and_hold(status, ttl, KEYS[5], KEYS[4], slot, now, late, a) then
  return {2, slot, now, count, window}
end
start_call(KEYS[6], token, now, a.bound, window)
return {status, slot, now, count, window, math.floor((n + 1) * 1000 / count)}

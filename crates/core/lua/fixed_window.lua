-- fixed_window: the classic counter per window of WINDOW µs aligned to Redis time, with
-- reservations in later windows. Not exact over a sliding window: up to 2*COUNT grants can fall
-- within one WINDOW across a window edge. GUARD is not added (windows stay aligned); it only
-- sets how early a due slot may be granted.
--
-- KEYS[1]  the seller's counters (hash: window index -> slots taken in it; `next` = the first
--          window that may still have room)
-- KEYS[2]  the seller's limit override ("COUNT WINDOW_US"), may be absent
-- KEYS[3]  the seller's pause ("UNTIL_US"), may be absent
-- KEYS[4]  the seller's reserved slots (sorted set: member = TOKEN, score = slot; see the prelude)
-- KEYS[5]  the seller's server stamp (run id of the Redis that wrote its state; see the prelude)
-- KEYS[6]  the seller's calls (unused: this algorithm is not exact, see README)
-- KEYS[7]  the seller's far queue (hash: at, n; see far_ticket in the prelude)
-- KEYS[8]  optional: the message's completion record; if it exists nothing is written
-- ARGV[1]  default COUNT (integer >= 1)
-- ARGV[2]  default WINDOW in µs (integer >= 1)
-- ARGV[3]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- ARGV[4]  FLAGS: +1 = reserve a future slot for a caller who must wait (else only answer);
--          +2 = Redis keeps its data across restarts (no cold-start wait, see the prelude)
-- ARGV[5]  HORIZON in µs: a slot further away than this is never reserved
-- ARGV[6]  TOKEN: a string unique to this attempt (letters, digits, dashes; at most 64)
-- ARGV[7]  BOUND (unused: calls are not tracked)
-- Returns {STATUS, SLOT_US, NOW_US, COUNT, WINDOW_US, USED_PERMILLE}
--   STATUS 1 = granted (call now), 2 = reserved (call at SLOT), 0 = denied (come back at SLOT;
--   with reserving on, when the seller's reserved set is full: see far_ticket),
--   3 = the message already registered (KEYS[8] says so);
--   USED_PERMILLE (with STATUS 1) is how much of the limit is taken after
--   this grant, in thousandths (slots in the slot's window / COUNT): the near-limit metric;

local a = acquire_args()
local count, window = effective_limit(KEYS[2], a.count, a.window)
local guard = guard_for(window, a.guard)
local now = now_us()
if already_done(KEYS[8]) then return {3, now, now, count, window} end
check_server(KEYS[5], KEYS[1], KEYS[3], window, now, a.durable)
local at = math.max(now, paused_until(KEYS[3]))

local current = math.floor(now / window)
local index = math.max(math.floor(at / window), tonumber(redis.call('HGET', KEYS[1], 'next') or '0'))
-- Windows from `next` on fill in order, so this walks only over windows filled meanwhile.
while tonumber(redis.call('HGET', KEYS[1], string.format('%.0f', index)) or '0') >= count do
  index = index + 1
end
local slot = math.max(index * window, at)

local status = due(slot, now, guard, a)
local late = lateness('fixed-window', window, guard)
status, slot = slot_or_far_ticket(status, slot, KEYS[4], KEYS[7], now, late, window, count)
if status == 0 then return {0, slot, now, count, window} end
local used = redis.call('HINCRBY', KEYS[1], string.format('%.0f', index), 1)
local next_index = index
if used >= count then next_index = index + 1 end
redis.call('HSET', KEYS[1], 'next', next_index)
for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
  local w = tonumber(field)
  if field ~= 'next' and w and w < current then redis.call('HDEL', KEYS[1], field) end
end
local last_end = (math.max(next_index, index + 1)) * window
local ttl = math.floor((last_end - now) / 1000) + 1
redis.call('PEXPIRE', KEYS[1], ttl)
if keep_and_hold(status, ttl, KEYS[5], KEYS[4], slot, now, late, a) then
  return {2, slot, now, count, window}
end
return {status, slot, now, count, window, math.floor(used * 1000 / count)}

-- gcra: generic cell rate algorithm with O(1) state per seller (its theoretical arrival time).
-- Emission interval T = (WINDOW+GUARD) / (COUNT - BURST + 1), tolerance (BURST-1)*T: no window
-- of WINDOW+GUARD holds more than COUNT grants. Reserving advances the TAT; the caller keeps the
-- returned slot, nothing per caller is stored.
--
-- KEYS[1]  the seller's TAT (string, µs, Redis time)
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
-- ARGV[8]  BURST (integer >= 1; at most COUNT)
-- Returns {STATUS, SLOT_US, NOW_US, COUNT, WINDOW_US, USED_PERMILLE}
--   STATUS 1 = granted (call now), 2 = reserved (call at SLOT), 0 = denied (come back at SLOT;
--   with reserving on, when the seller's reserved set is full: see far_ticket),
--   3 = the message already registered (KEYS[8] says so);
--   USED_PERMILLE (with STATUS 1) is how much of the limit is taken after
--   this grant, in thousandths (TAT ahead of now / BURST intervals): the near-limit metric;

local a = acquire_args()
local burst = int_arg(8, 1)
local count, window = effective_limit(KEYS[2], a.count, a.window)
burst = math.min(burst, count)
local guard = guard_for(window, a.guard)
local interval = (window + guard) / (count - burst + 1)
local now = now_us()
if already_done(KEYS[8]) then return {3, now, now, count, window} end
check_server(KEYS[5], KEYS[1], KEYS[3], window + guard, now, a.durable)

local tat = math.max(tonumber(redis.call('GET', KEYS[1]) or '0'), now)
local slot = math.max(tat - (burst - 1) * interval, now)
local pause = paused_until(KEYS[3])
if pause > slot then
  slot = pause
  tat = math.max(tat, pause)
end

local status = due(slot, now, guard, a)
local late = lateness('gcra', window, guard)
-- Due, but calls of the last window may still be in flight: wait for their answers.
slot, status = after_gate(status, slot, KEYS[6], now, window, count, guard, a.reserve)
status, slot = slot_or_far_ticket(status, slot, KEYS[4], KEYS[7], now, late, window + guard, count)
if status == 0 then return {0, slot, now, count, window} end
local next_tat = tat + interval
local ttl = math.floor((next_tat - now) / 1000) + 1
redis.call('SET', KEYS[1], string.format('%.0f', next_tat), 'PX', ttl)
if keep_and_hold(status, ttl, KEYS[5], KEYS[4], slot, now, late, a) then
  return {2, slot, now, count, window}
end
start_call(KEYS[6], a.token, now, a.bound, window)
return {status, slot, now, count, window, math.floor((next_tat - now) * 1000 / (burst * interval))}

-- redeem: a caller comes back for the slot it reserved. Granted if the slot is due (at most
-- GUARD/10 ahead, at most GUARD/2 past), the seller is not paused past it, and the limit it was
-- reserved under still applies. Writes nothing: the slot was counted when it was reserved.
--
-- KEYS[1]  the seller's limit override ("COUNT WINDOW_US"), may be absent
-- KEYS[2]  the seller's pause ("UNTIL_US"), may be absent
-- KEYS[3]  the seller's limiter state (to notice a Redis that lost its data, see cold_start)
-- KEYS[4]  optional: the message's completion record
-- ARGV[1]  default COUNT (integer >= 1)
-- ARGV[2]  default WINDOW in µs (integer >= 1)
-- ARGV[3]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- ARGV[4]  SLOT in µs (Redis time), as returned when it was reserved
-- ARGV[5]  COUNT the slot was reserved under
-- ARGV[6]  WINDOW_US the slot was reserved under
-- ARGV[7]  FLAGS: +2 = Redis keeps its data across restarts (no cold-start wait)
-- ARGV[8]  EPOCH: the run id of the Redis server the slot was reserved on
-- Returns {STATUS, AT_US, NOW_US}
--   1 granted; 2 early: come back at AT; 3 paused until AT; 4 the limit changed; 5 too late;
--   6 the message already registered (KEYS[4] exists); 7 the slot was reserved on another
--   incarnation of the server (Redis restarted or failed over: its schedule is gone).
--   3, 4, 5 and 7 give the slot up: the caller acquires a new one.

local default_count, default_window, guard = int_arg(1, 1), int_arg(2, 1), int_arg(3, -1)
local slot, held_count, held_window = int_arg(4, 0), int_arg(5, 1), int_arg(6, 1)
local durable = int_arg(7, 0) >= 2
local count, window = effective_limit(KEYS[1], default_count, default_window)
guard = guard_for(window, guard)
local now = now_us()
if already_done(KEYS[4]) then return {6, now, now} end
cold_start(KEYS[3], KEYS[2], window + guard, now, durable)
local pause = paused_until(KEYS[2])
if ARGV[8] ~= server().run_id then return {7, now, now} end
if pause > slot then return {3, pause, now} end
if count ~= held_count or window ~= held_window then return {4, now, now} end
if now < slot - math.floor(guard / 10) then return {2, slot, now} end
if now > slot + math.floor(guard / 2) then return {5, now, now} end
return {1, slot, now}

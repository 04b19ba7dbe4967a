-- @include args
-- @include limits
-- @include pauses
-- @include terms
-- @include time
-- reset: forgets a seller's limiter state (`turnstile limits reset`) without letting a burst
-- through. In one atomic step the seller is paused until SPAN from now (the longest window of
-- its limits plus its guard; a longer pause is kept), so that no call granted under the
-- forgotten state shares a window with a new one, and the state is deleted: its log, TAT,
-- bucket or window counters, reserved slots (their holders reserve anew), far queue, pool of
-- permit-block units, learned limit and server stamp. Its override, weight, shadow limit, calls
-- in flight, leases and completion records are kept.
--
-- KEYS[1]  the seller's pause ("UNTIL_US")
-- KEYS[2]  the seller's limit override ("COUNTS WINDOWS_US"), may be absent: read for SPAN
-- KEYS[3…] the seller's keys to forget
-- ARGV[1]  default COUNTS, comma-separated (integers >= 1; 1 to 8 limits)
-- ARGV[2]  default WINDOWS in µs, comma-separated, one per count (integers >= 1)
-- ARGV[3]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- Returns {PAUSED_UNTIL_US, NOW_US, FORGOTTEN}: the pause's end, Redis time, and how many of
--   the keys existed

local limits = with_spans(effective_limits(KEYS[2], limits_arg(1), nil, 1), int_arg(3, -1))
if #KEYS < 2 then error({err = 'ERR turnstile: reset needs KEYS[1] and KEYS[2]'}) end
local now = now_us()
local until_us = extend_pause(KEYS[1], now + limits.max_span, now)
local forgotten = 0
for i = 3, #KEYS do
  forgotten = forgotten + redis.call('DEL', KEYS[i])
end
return {until_us, now, forgotten}

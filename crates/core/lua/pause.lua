-- @include args
-- @include pauses
-- @include time
-- pause: no permit is granted for the seller until now + FOR (Redis time), on every replica.
-- A pause only extends: a shorter one never cuts a longer one short.
--
-- KEYS[1]  the seller's pause ("UNTIL_US")
-- ARGV[1]  FOR in µs (integer >= 1)
-- Returns the pause's end in µs (Redis time)

local duration = int_arg(1, 1)
local now = now_us()
return extend_pause(KEYS[1], now + duration, now)

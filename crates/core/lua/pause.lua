-- pause: no permit is granted for the seller until now + FOR (Redis time), on every replica.
-- A pause only extends: a shorter one never cuts a longer one short.
--
-- KEYS[1]  the seller's pause ("UNTIL_US")
-- ARGV[1]  FOR in µs (integer >= 1)
-- Returns the pause's end in µs (Redis time)

local duration = int_arg(1, 1)
local until_us = now_us() + duration
local current = paused_until(KEYS[1])
if current >= until_us then return current end
redis.call('SET', KEYS[1], string.format('%.0f', until_us), 'PX', math.floor(duration / 1000) + 1)
return until_us

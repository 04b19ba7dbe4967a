-- @include time
-- retries: a seller's messages waiting out a retry's backoff (see retry.lua) whose retry is not
-- due yet, for the ETA. Reads only; never writes.
--
-- KEYS[1]  the seller's retries (sorted set, see retry.lua)
-- Returns {MEMBER, DUE_IN_MS, ...}: each retry not due yet and how long until it is (ms, Redis
--   time), soonest first

local now = math.floor(now_us() / 1000)
local found = redis.call('ZRANGEBYSCORE', KEYS[1], string.format('(%d', now), '+inf', 'WITHSCORES')
for i = 2, #found, 2 do
  found[i] = tonumber(found[i]) - now
end
return found

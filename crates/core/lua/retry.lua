-- @include args
-- @include time
-- retry: notes a message of a batch waiting out a retry's backoff (the worker delayed it after a
-- failed attempt), for the ETA only: no grant reads it. A message's entry is replaced by its
-- next retry; entries past due are dropped (the message is back, or about to be), and the key
-- expires when its latest retry is due.
--
-- KEYS[1]  the seller's retries (sorted set: MEMBER -> when the retry is due, Unix ms, Redis
--          time)
-- ARGV[1]  DELAY_MS: the backoff, from now (integer >= 0)
-- ARGV[2]  MEMBER: `COST:BATCH:MESSAGE` (1 to 4096 bytes; see Records::retry_due)
-- ARGV[3]  KEEP: most entries kept, the latest due (integer >= 1)
-- Returns the seller's retries not due yet, this one included (at most KEEP)

local delay = int_arg(1, 0)
local member = ARGV[2]
if member == nil or #member < 1 or #member > 4096 then
  error({err = 'ERR turnstile: MEMBER must be 1 to 4096 bytes'})
end
local keep = int_arg(3, 1)
local now = math.floor(now_us() / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + delay, member)
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -keep - 1)
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(last[2]) - now, 1))
return redis.call('ZCARD', KEYS[1])

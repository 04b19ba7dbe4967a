-- @include args
-- @include batches
-- batch_seen: notes a batch as a replica first sees one of its messages, before any of them is
-- registered or dead-lettered, so that its total and start are known from its first seconds
-- (complete.lua writes the same on each count: whichever runs first describes it).
--
-- KEYS[1]  the batch's progress (hash, see complete.lua)
-- KEYS[2]  the seller's batches (sorted set: batch id -> first seen, Unix ms; the 1,000 newest
--          younger than TTL)
-- ARGV[1]  TTL in ms (integer >= 1): kept this long after its last change
-- ARGV[2]  SELLER (ARGV[2] to ARGV[4]: see batch_args in include/batches.lua)
-- ARGV[3]  BATCH
-- ARGV[4]  BATCH_SIZE
-- ARGV[5]  optional: ROWS_PER_CALL (integer 1 to 1000): how many of its rows one permit
--          carries (a bulk route's max_rows where a call counts once), kept as `rows_per_call`
--          when above 1 (the ETA counts its waiting rows by it)
-- Returns {FIRST_MS, EVENT}: when the batch was first seen (Unix ms, Redis time), and its
--   pending completion event (see batch_event in include/batches.lua) or ''

local ttl = int_arg(1, 1)
local batch = batch_args(2)
local rows_per_call = 1
if ARGV[5] ~= nil then rows_per_call = int_arg(5, 1) end
if rows_per_call > 1000 then
  error({err = 'ERR turnstile: ROWS_PER_CALL must be at most 1000'})
end
describe_batch(KEYS[1], batch)
if rows_per_call > 1 then redis.call('HSET', KEYS[1], 'rows_per_call', rows_per_call) end
local event = batch_event(KEYS[1])
-- Renewed only while the batch is open: a finished batch expires TTL after its last message.
if redis.call('PTTL', KEYS[1]) < 0 or redis.call('HEXISTS', KEYS[1], 'completed_ms') == 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
local first_ms = tonumber(redis.call('HGET', KEYS[1], 'first_ms'))
redis.call('ZADD', KEYS[2], first_ms, batch.id)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', first_ms - ttl)
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -1001)
redis.call('PEXPIRE', KEYS[2], ttl)
return {first_ms, event}

-- complete: records that a message registered (once), or was dead-lettered.
-- The completion record lets a redelivered message that already registered be acked without a
-- second downstream call; the batch's progress feeds `turnstile status`. A dead letter gets no
-- completion record, so that it can be replayed.
--
-- KEYS[1]  the message's completion record (string)
-- KEYS[2]  optional: the batch's progress (hash: registered, dead, first_ms, last_ms)
-- ARGV[1]  TTL of both, in ms (integer >= 1)
-- ARGV[2]  OUTCOME: `registered` or `dead`
-- Returns 1 when newly recorded, 0 when the message was already recorded

local ttl = int_arg(1, 1)
local outcome = ARGV[2]
if outcome ~= 'registered' and outcome ~= 'dead' then
  error({err = 'ERR turnstile: OUTCOME must be registered or dead'})
end
if outcome == 'registered' and not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ttl) then
  return 0
end
if KEYS[2] then
  local ms = math.floor(now_us() / 1000)
  redis.call('HINCRBY', KEYS[2], outcome, 1)
  redis.call('HSETNX', KEYS[2], 'first_ms', ms)
  redis.call('HSET', KEYS[2], 'last_ms', ms)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return 1

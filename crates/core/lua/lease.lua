-- @include args
-- @include time
-- lease: at most LIMIT calls of one seller in flight across every replica
-- (TURNSTILE_SELLER_CONCURRENCY). Asked once the seller's own permit granted a call now; the
-- call is made only while holding a lease. A lease ends when its call is answered (the worker
-- removes it, ZREM) or, if that never happens (a replica killed mid-call, Redis unreachable),
-- at its expiry: the latest the call's answer or timeout can come back. So a crash holds a
-- seller back at most one call bound.
-- A refused caller is told to come back at the seller's next lease ticket: the seller's
-- refused callers come back POLL apart, not all at once (an answer usually frees a lease long
-- before its expiry, so they ask again rather than wait for it).
--
-- KEYS[1]  the seller's leases (sorted set: member = TOKEN of the call, score = expiry µs)
-- KEYS[2]  the seller's next lease ticket (string: µs, Redis time)
-- ARGV[1]  LIMIT: most calls in flight at once (integer >= 1)
-- ARGV[2]  TOKEN of the call (letters, digits, dashes; at most 64)
-- ARGV[3]  BOUND in µs: the latest the call's answer or timeout comes back (integer >= 1)
-- ARGV[4]  POLL in µs: the spacing of refused callers' tickets (integer >= 1)
-- Returns {STATUS, AT_US, NOW_US}: 1 = leased (call now); 0 = LIMIT calls in flight: come back
--   at AT (the seller's next ticket)

local limit = int_arg(1, 1)
local token = token_arg(2)
local bound = int_arg(3, 1)
local poll = int_arg(4, 1)
local now = now_us()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= limit then
  local ticket = math.max(now + poll, tonumber(redis.call('GET', KEYS[2]) or '0') or 0)
  redis.call('SET', KEYS[2], string.format('%.0f', ticket + poll), 'PX',
    math.floor((ticket + poll - now) / 1000) + 1)
  return {0, ticket, now}
end
redis.call('ZADD', KEYS[1], now + bound, token)
local last = tonumber(redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2])
redis.call('PEXPIRE', KEYS[1], math.floor((last - now) / 1000) + 1)
return {1, now, now}

-- @include args
-- @include limits
-- @include time
-- global_usage: how much of the global limit is taken now and by whom (for the dashboard and
-- `turnstile status`; the limiter never needs it). Reads only.
--
-- KEYS[1..8]  the global limit's keys, as global.lua takes them
-- ARGV[1]  COUNTS of the global stack, comma-separated
-- ARGV[2]  WINDOWS in µs, comma-separated
-- ARGV[3]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- Returns {NOW_US, COMPETING, WEIGHTS, then per limit of the stack in its order: USED, COUNT,
--   then per seller with units in the shortest window: SELLER, UNITS, WEIGHT}: COMPETING is how
--   many sellers are being refused now (see global.lua), WEIGHTS their weights together (as a
--   string), WEIGHT the seller's weight in force.

local limits = with_spans(limits_arg(1), int_arg(3, -1))
local now = now_us()
local answer = {now, redis.call('ZCOUNT', KEYS[4], string.format('(%.0f', now), '+inf'),
  redis.call('HGET', KEYS[2], 'w') or '0'}
for _, l in ipairs(limits) do
  answer[#answer + 1] = redis.call('ZCOUNT', KEYS[1], string.format('(%.0f', now - l.span), '+inf')
  answer[#answer + 1] = l.count
end
local by_seller, order = {}, {}
local recent = redis.call('ZRANGEBYSCORE', KEYS[1], string.format('(%.0f', now - limits.min_span), '+inf')
for _, member in ipairs(recent) do
  local s = string.match(member, '|(.*)$')
  if s then
    if by_seller[s] == nil then
      by_seller[s] = 0
      order[#order + 1] = s
    end
    by_seller[s] = by_seller[s] + 1
  end
end
for _, s in ipairs(order) do
  answer[#answer + 1] = s
  answer[#answer + 1] = by_seller[s]
  local w = redis.call('HGET', KEYS[6], 'w|' .. s) or redis.call('HGET', KEYS[5], s) or '1'
  answer[#answer + 1] = math.min(math.max(math.floor(tonumber(w) or 1), 1), 1000)
end
return answer

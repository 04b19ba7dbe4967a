-- @include args
-- @include time
-- @include units
-- recost: the downstream reported what a granted call really cost (TURNSTILE_COST_HEADER):
-- its units in the seller's windows become ACTUAL instead of the COST it was granted for, for
-- every replica at once, as the downstream counts them. A refund removes the units beyond ACTUAL
-- (the seller's next calls may take them at once); an extra charge adds the units beyond COST
-- at the call's SLOT (its windows then hold what the downstream counted, and the next calls wait
-- for them to leave). The seller's calls change alike (an added unit ends when the call did),
-- and so does the route's log for a call on a route. sliding-window only.
--
-- KEYS[1]  the seller's log (sorted set: the units of each TOKEN, score = slot)
-- KEYS[2]  the seller's calls (sorted set: the units of each TOKEN, score = END)
-- KEYS[3]  optional: the route's log for the seller (see include/routes.lua)
-- ARGV[1]  TOKEN of the call (letters, digits, dashes; at most 64)
-- ARGV[2]  COST it was granted for (integer from 1 to MAX_COST)
-- ARGV[3]  ACTUAL: what the downstream reported (integer from 0 to MAX_COST)
-- ARGV[4]  SLOT in µs: the grant's slot (where added units are written)
-- Returns the units added (> 0) or removed (< 0)

local token = token_arg(1)
local cost = int_arg(2, 1)
local actual = int_arg(3, 0)
if cost > MAX_COST or actual > MAX_COST then
  error({err = 'ERR turnstile: COST and ACTUAL must be at most ' .. MAX_COST})
end
local slot = int_arg(4, 0)
if actual == cost then return 0 end
local logs = {KEYS[1]}
if KEYS[3] ~= nil then logs[2] = KEYS[3] end

if actual < cost then
  for _, key in ipairs(logs) do for_units('ZREM', key, token, cost, nil, actual + 1) end
  for_units('ZREM', KEYS[2], token, cost, nil, actual + 1)
  return actual - cost
end
-- Only where the call's units still are (a key that expired holds nothing to correct).
if redis.call('ZSCORE', KEYS[1], token) == false then return 0 end
for _, key in ipairs(logs) do
  if redis.call('EXISTS', key) == 1 then
    for_units('ZADD', key, token, actual, string.format('%.0f', slot), cost + 1)
  end
end
local ends = redis.call('ZSCORE', KEYS[2], token)
if ends == false then ends = string.format('%.0f', now_us()) end
for_units('ZADD', KEYS[2], token, actual, ends, cost + 1)
return actual - cost

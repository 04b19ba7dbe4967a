-- @include args
-- @include charges
-- @include time
-- @include units
-- recost: the downstream reported what a granted call really cost (TURNSTILE_COST_HEADER):
-- its units in the seller's windows become ACTUAL instead of the COST it was granted for, for
-- every replica at once, as the downstream counts them. A refund removes the units beyond ACTUAL
-- (the seller's next calls may take them at once); an extra charge adds the units beyond COST
-- at the call's SLOT (its windows then hold what the downstream counted, and the next calls wait
-- for them to leave). The seller's calls change alike (an added unit ends when the call did),
-- and so does the route's log for a call on a route. sliding-window only.
-- In the same step, the charge of the call's endpoint is learned (see learn_charge in
-- include/charges.lua), for the next calls to ask for it; when it rises, the reservations on the
-- endpoint made for fewer units are given back (give_back_cheaper), to be asked again at it.
--
-- KEYS[1]  the seller's log (sorted set: the units of each TOKEN, score = slot)
-- KEYS[2]  the seller's calls (sorted set: the units of each TOKEN, score = END)
-- KEYS[3]  the seller's reserved slots (sorted set: member = held_name(TOKEN, COST), score = slot)
-- KEYS[4]  the charge learned for the call's endpoint (string: CHARGE; see include/charges.lua)
-- KEYS[5]  optional: the route's log for the seller (see include/routes.lua)
-- ARGV[1]  TOKEN of the call (letters, digits, dashes; at most 64)
-- ARGV[2]  COST it was granted for (integer from 1 to MAX_COST)
-- ARGV[3]  ACTUAL: what the downstream reported (integer from 0 to MAX_COST)
-- ARGV[4]  SLOT in µs: the grant's slot (where added units are written)
-- ARGV[5]  REQUESTED: the units its message asked for (integer from 1 to COST)
-- ARGV[6]  MEMORY in ms: how long a charge learned is kept after the last answer that set or
--          confirmed it (integer >= 1)
-- Returns {CHANGED, CHARGE, GIVEN_BACK}: the units added (> 0) or removed (< 0), the charge
-- learned now (0 = none), the reservations given back

local token = token_arg(1)
local cost = int_arg(2, 1)
local actual = int_arg(3, 0)
if cost > MAX_COST or actual > MAX_COST then
  error({err = 'ERR turnstile: COST and ACTUAL must be at most ' .. MAX_COST})
end
local slot = int_arg(4, 0)
local requested = int_arg(5, 1)
if requested > cost then error({err = 'ERR turnstile: REQUESTED must be at most COST'}) end
local memory = int_arg(6, 1)
local charge, raised = learn_charge(KEYS[4], requested, cost, actual, memory)
local given = 0
if raised then given = give_back_cheaper(KEYS[3], KEYS[1], KEYS[5], charge) end
if actual == cost then return {0, charge, given} end
local logs = {KEYS[1]}
if KEYS[5] ~= nil then logs[2] = KEYS[5] end

if actual < cost then
  for _, key in ipairs(logs) do for_units('ZREM', key, token, cost, nil, actual + 1) end
  for_units('ZREM', KEYS[2], token, cost, nil, actual + 1)
  return {actual - cost, charge, given}
end
-- Only where the call's units still are (a key that expired holds nothing to correct).
if redis.call('ZSCORE', KEYS[1], token) == false then return {0, charge, given} end
for _, key in ipairs(logs) do
  if redis.call('EXISTS', key) == 1 then
    for_units('ZADD', key, token, actual, string.format('%.0f', slot), cost + 1)
  end
end
local ends = redis.call('ZSCORE', KEYS[2], token)
if ends == false then ends = string.format('%.0f', now_us()) end
for_units('ZADD', KEYS[2], token, actual, ends, cost + 1)
return {actual - cost, charge, given}

-- @include args
-- @include limits
-- @include reservations
-- @include routes
-- @include states
-- unreserve: gives back a reserved slot whose message will not come back for it (its delayed
-- copy could not be published, it was returned to the broker, or the replica shut down before
-- it was published), so that the seller's next caller may take it. Only a live reservation
-- (its entry in the reserved set, at this slot or, moved back by a message ranked ahead of it
-- (give_way in include/ranks.lua), later) is given back, at the slot it holds now; a redeemed,
-- forfeited or already given back one is left as it is.
--
-- KEYS[1]  the seller's limiter state for ALGORITHM
-- KEYS[2]  the seller's reserved slots (sorted set: member = held_name(TOKEN, COST), score = slot)
-- KEYS[3]  with ROUTE: the route's log for the seller (see include/routes.lua)
-- KEYS[4]  with ROUTE: the seller's override of the route's stack
-- ARGV[1]  ALGORITHM: sliding-window, gcra, token-bucket or fixed-window
-- ARGV[2]  TOKEN the slot was reserved with (letters, digits, dashes; at most 64)
-- ARGV[3]  COST the slot was reserved for (integer from 1 to 10000)
-- ARGV[4]  SLOT in µs (Redis time), as returned when it was reserved
-- ARGV[5]  COUNTS the slot was reserved under
-- ARGV[6]  WINDOWS_US the slot was reserved under
-- ARGV[7]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- ARGV[8]  token-bucket: CAPACITY (integer >= 0; see with_capacities); others: ignored
-- ARGV[9]  optional ROUTE: the route's COUNTS: the reservation's units leave the route's log
--          too
-- ARGV[10] with ROUTE: the route's WINDOWS in µs
-- Returns 1 if the reservation was given back, 0 if there was none to give back

local algorithm = algorithm_arg(1)
local token = token_arg(2)
local cost = int_arg(3, 1)
if cost > MAX_COST then error({err = 'ERR turnstile: COST must be at most ' .. MAX_COST}) end
local slot = int_arg(4, 0)
local held = with_capacities(with_spans(limits_arg(5), int_arg(7, -1)), int_arg(8, 0))
local name = held_name(token, cost)
local holds = tonumber(redis.call('ZSCORE', KEYS[2], name))
if holds == nil or holds < slot then return 0 end
redis.call('ZREM', KEYS[2], name)
local route = route_arg(9, KEYS[3], KEYS[4], int_arg(7, -1), cost)
give_back(algorithm, KEYS[1], token, cost, holds, held, route and {route.log})
return 1

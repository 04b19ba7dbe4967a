-- @include args
-- @include routes
-- @include limits
-- @include states
-- @include terms
-- @include units
-- release: gives back a grant that will not be called (the global limit refused it, see
-- global.lua), so that the seller's next call may take its units at once:
--   sliding-window, fixed-window  its units leave the log or the window counters: exact;
--   token-bucket                  its tokens go back into each bucket (up to its capacity);
--   gcra                          nothing: a TAT cannot free a slot inside its schedule (the
--                                 slot stays unused: a capacity loss, never an excess).
-- The exact algorithms also drop the call from the seller's calls (it was never sent).
--
-- KEYS[1]  the seller's limiter state for ALGORITHM
-- KEYS[2]  the seller's limit override ("COUNTS WINDOWS_US"), may be absent
-- KEYS[3]  the seller's calls (sorted set: the units of each TOKEN, score = END)
-- KEYS[4]  optional (adaptive limits on): the seller's learned state (see with_learned)
-- KEYS[-2], KEYS[-1]  with ROUTE: the route's log for the seller and the seller's override of
--          the route's stack (see include/routes.lua); the last two keys
-- ARGV[1]  default COUNTS, comma-separated (integers >= 1; 1 to 8 limits)
-- ARGV[2]  default WINDOWS in µs, comma-separated, one per count (integers >= 1)
-- ARGV[3]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- ARGV[4]  ALGORITHM: sliding-window, gcra, token-bucket or fixed-window
-- ARGV[5]  TOKEN: the grant's call (letters, digits, dashes; at most 64)
-- ARGV[6]  COST: the units it took (integer from 1 to 10000)
-- ARGV[7]  SLOT in µs: when it was counted (the grant's slot)
-- ARGV[8]  token-bucket: CAPACITY (integer >= 0; see with_capacities); others: ignored
-- ARGV[9]  optional ROUTE: the route's COUNTS: the grant's units leave the route's log too
-- ARGV[10] with ROUTE: the route's WINDOWS in µs
-- Returns 1

local default = limits_arg(1)
local guard = int_arg(3, -1)
local algorithm = algorithm_arg(4)
local token = token_arg(5)
local cost = int_arg(6, 1)
if cost > MAX_COST then error({err = 'ERR turnstile: COST must be at most ' .. MAX_COST}) end
local slot = int_arg(7, 0)
local capacity = int_arg(8, 0)
local learned_key = KEYS[4]
local route = nil
if ARGV[9] ~= nil then
  if #KEYS < 5 then error({err = 'ERR turnstile: ROUTE needs its two keys last'}) end
  if #KEYS == 5 then learned_key = nil end
  route = route_arg(9, KEYS[#KEYS - 1], KEYS[#KEYS], guard, cost)
end
local limits = with_capacities(with_spans(effective_limits(KEYS[2], default, learned_key, cost), guard), capacity)
give_back(algorithm, KEYS[1], token, cost, slot, limits, route and {route.log})
if algorithm == 'sliding-window' or algorithm == 'gcra' then remove_units(KEYS[3], token, cost) end
return 1

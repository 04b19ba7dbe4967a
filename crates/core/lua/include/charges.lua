-- @include args
-- @include reservations
-- @include routes
-- @include units
-- charges: what the downstream charges a seller's calls on one endpoint (the default endpoint or
-- a route), learned from the costs its answers report (TURNSTILE_COST_HEADER), so that the next
-- calls ask for it before they are made (the caller reads it: PermitStore::cost_to_ask).
-- The learned charge is a string key per seller and endpoint: an integer from 1 to MAX_COST,
-- kept MEMORY ms after the last answer that set or confirmed it.
-- Defines: learned_charge, learn_charge, give_back_cheaper

-- The charge the string KEY holds: an integer from 1 to MAX_COST, else nil (anything else the
-- key may hold is ignored and overwritten by the next charge learned).
local function learned_charge(key)
  local n = tonumber(redis.call('GET', key) or '')
  if n == nil or n ~= math.floor(n) or n < 1 or n > MAX_COST then return nil end
  return n
end

-- Learns from the answer of a call whose message asked REQUESTED units, granted COST units
-- (REQUESTED, or the charge learned then when higher) and reported ACTUAL:
--   - a charge above REQUESTED is learned when it is higher than the charge known (whoever
--     asked: a call granted before it was learned says so too), or when the call asked at least
--     the charge known (its report is current: it lowers or confirms it);
--   - a call that asked at least the charge known and cost no more than REQUESTED, below the
--     charge known, forgets it (the endpoint no longer charges extra);
--   - a call granted below the charge known (before it was learned) and charged no more than
--     it says nothing new.
-- Returns the charge known now (0 = none) and whether it was raised (none before, or lower).
local function learn_charge(key, requested, cost, actual, memory)
  local known = learned_charge(key)
  local current = known == nil or cost >= known
  if actual > requested and (current or actual > known) then
    redis.call('SET', key, actual, 'PX', memory)
    return actual, known == nil or actual > known
  end
  if current and known ~= nil and actual < known then
    redis.call('DEL', key)
    return 0, false
  end
  return known or 0, false
end

-- Gives back the seller's reservations (RESERVED_KEY) on one endpoint made for fewer than
-- CHARGE units: their units leave the seller's log (LOG_KEY) and, on a route, its log
-- (ROUTE_LOG, nil for the default endpoint: then only reservations not made on a route, see
-- routed). Their messages come back, find their slot gone (redeem.lua answers 8) and ask again,
-- at the charge now learned. Returns how many were given back.
local function give_back_cheaper(reserved_key, log_key, route_log, charge)
  local given = 0
  for _, member in ipairs(redis.call('ZRANGE', reserved_key, 0, -1)) do
    local token, cost = held_parts(member)
    if token ~= nil and cost < charge then
      local here
      if route_log == nil then
        here = not routed(token)
      else
        here = routed(token) and redis.call('ZSCORE', route_log, token) ~= false
      end
      if here then
        redis.call('ZREM', reserved_key, member)
        remove_units(log_key, token, cost)
        if route_log ~= nil then remove_units(route_log, token, cost) end
        given = given + 1
      end
    end
  end
  return given
end

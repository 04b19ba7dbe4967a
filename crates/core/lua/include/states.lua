-- @include routes
-- @include units
-- states: how the algorithms keep a seller's state (fixed-window's counters, token-bucket's
-- buckets), and giving a slot's units back to it (give_back).
-- Defines: fw_field, fw_next, tb_field, with_capacities, give_back

-- fixed-window: the field of the counter of window INDEX of the limit L of a stack
-- (WINDOW_US:INDEX), and the field of that limit's `next` (WINDOW_US:next: the first window
-- that may still have room). A stack's windows differ, so each limit has fields of its own.
local function fw_field(l, index)
  return string.format('%.0f:%.0f', l.window, index)
end
local function fw_next(l)
  return string.format('%.0f:next', l.window)
end

-- token-bucket: the field holding the I-th bucket's tokens (`tokens`, then `tokens2`, ...; the
-- buckets share the field `ts`, the µs at which they hold).
local function tb_field(i)
  if i == 1 then return 'tokens' end
  return 'tokens' .. i
end

-- token-bucket: each limit's bucket holds CAPACITY tokens when it is the only limit and
-- CAPACITY > 0, else its COUNT.
local function with_capacities(limits, capacity)
  for _, l in ipairs(limits) do
    l.capacity = l.count
    if #limits == 1 and capacity > 0 then l.capacity = capacity end
  end
  return limits
end

-- Gives the COST units reserved with TOKEN at SLOT (under the stack LIMITS) back to the seller's
-- state of ALGORITHM, so that the next caller may take them (the reservation itself is removed
-- from the reserved set by the caller):
--   sliding-window  its log entries (the units of TOKEN) are removed: exact; for a reservation
--                   on a route (see routed), from each of ROUTE_LOGS too (the seller's logs of
--                   the routes, when the caller knows them; else the route's units stay counted
--                   until they leave its windows: capacity unused, never an excess);
--   fixed-window    each limit's counter of the slot's window goes down by COST, and the window
--                   is open again: exact;
--   token-bucket    COST tokens go back into each bucket (capped at its capacity; see
--                   with_capacities for LIMITS' capacities);
--   gcra            nothing: a TAT cannot free a slot inside its schedule; the slot stays unused
--                   (a capacity loss, never an excess). See reschedule.lua for giving back a
--                   whole schedule's reservations at once.
local function give_back(algorithm, state_key, token, cost, slot, limits, route_logs)
  if algorithm == 'sliding-window' then
    remove_units(state_key, token, cost)
    if route_logs ~= nil and routed(token) then
      for _, key in ipairs(route_logs) do remove_units(key, token, cost) end
    end
  elseif algorithm == 'fixed-window' then
    for _, l in ipairs(limits) do
      local index = math.floor(slot / l.window)
      local field = fw_field(l, index)
      local taken = tonumber(redis.call('HGET', state_key, field) or '0')
      if taken > 0 then
        redis.call('HINCRBY', state_key, field, -math.min(taken, cost))
        if index < tonumber(redis.call('HGET', state_key, fw_next(l)) or '0') then
          redis.call('HSET', state_key, fw_next(l), string.format('%.0f', index))
        end
      end
    end
  elseif algorithm == 'token-bucket' then
    for i, l in ipairs(limits) do
      local tokens = tonumber(redis.call('HGET', state_key, tb_field(i)) or '')
      if tokens ~= nil then
        redis.call('HSET', state_key, tb_field(i), string.format('%.6f', math.min(tokens + cost, l.capacity)))
      end
    end
  end
end

-- @include states
-- @include reservations
-- @include tats
-- terms_change: what a change of a seller's terms (reschedule.lua, a lesson of learn.lua) does
-- to its state: every reserved slot given back at once, the state brought to the new stack.
-- Defines: give_back_reserved

-- Gives back every slot reserved by the seller (RESERVED_KEY, emptied) to its state of ALGORITHM
-- (STATE_KEY), made under the stack LIMITS, and brings that state to the stack NEW_LIMITS that
-- applies from now on (BURST: gcra's). Returns how many reservations were given back.
--   sliding-window  every reserved unit leaves the log: exact; a reservation on a route leaves
--                   each of ROUTE_LOGS too (see give_back);
--   fixed-window    every reserved slot's units leave its windows' counters: exact;
--   token-bucket    the buckets are brought to now, every reserved unit goes back into each
--                   (between 0 and its capacity: only reservations run into debt);
--   gcra            each limit's TAT moves back by one emission interval per reserved unit
--                   whose slot lies after every call made (later than GUARD/10 from now): those
--                   are the end of the schedule (a grant is only made when no slot lies ahead),
--                   so what is left is the schedule of the calls, at most BURST intervals past
--                   the latest a grant may be (a pause folded into the TAT ends there); the most
--                   cells any limit still holds are then spaced at each new limit's interval, at
--                   most one new window ahead (by then every earlier call has left any window).
--   fixed-window counters are kept per window index: a new WINDOW length starts new indexes
--   (the old counts no longer apply; fixed-window is not exact across its edges anyway).
local function give_back_reserved(algorithm, state_key, reserved_key, limits, new_limits, now, burst,
  route_logs)
  local reserved = redis.call('ZRANGE', reserved_key, 0, -1, 'WITHSCORES')
  local released = #reserved / 2
  local function units_of(members)
    local units = 0
    for i = 1, #members, 2 do
      local _, cost = held_parts(members[i])
      units = units + cost
    end
    return units
  end
  if algorithm == 'gcra' then
    local value = redis.call('GET', state_key)
    if value then
      local state = read_tats(value)
      -- The state as written (by another stack, if it says so: a replica may have brought it to
      -- the terms in force already, see tats_under).
      local from = written_under(state, limits) or limits
      -- Only units slotted after every call made so far (later than the earliest a grant may be)
      -- are the end of the schedule; an older, unredeemed one stays unused. Every one is given
      -- back: the calls' cells, spaced at each new interval, never more than one new span ahead.
      local early = math.floor(from.min_guard / 10)
      local ahead = units_after(reserved_key, now + early)
      local new_state = spaced(cells_ahead(state, from, burst, now, ahead, now + early), 0, new_limits, burst, now)
      if new_state.ahead > 0 then
        redis.call('SET', state_key, tats_text(new_state, new_limits), 'PX', math.floor(new_state.ahead / 1000) + 1)
      else
        redis.call('DEL', state_key)
      end
    end
  elseif algorithm == 'token-bucket' then
    local fields = {'ts'}
    for i = 1, #limits do fields[i + 1] = tb_field(i) end
    local state = redis.call('HMGET', state_key, unpack(fields))
    local ts = tonumber(state[1])
    if ts ~= nil then
      -- The buckets now, with the reserved units back. Only reservations run into debt (a grant
      -- needs the tokens at its slot, at most GUARD/10 ahead), so once they are all given back
      -- each bucket now holds at least nothing; a pause folded into TS is dropped the same way.
      local units = units_of(reserved)
      local write = {'ts', string.format('%.0f', now)}
      for i, l in ipairs(limits) do
        local tokens = tonumber(state[i + 1])
        if tokens ~= nil then
          local filled = tokens + (now - ts) * l.count / l.span + units
          write[#write + 1] = tb_field(i)
          write[#write + 1] = string.format('%.6f', math.min(math.max(filled, 0), l.capacity))
        end
      end
      redis.call('HSET', state_key, unpack(write))
    end
  else
    for i = 1, #reserved, 2 do
      local token, cost = held_parts(reserved[i])
      give_back(algorithm, state_key, token, cost, tonumber(reserved[i + 1]), limits, route_logs)
    end
    -- The windows are looked at again from now: a new COUNT may leave room in a full one.
    if algorithm == 'fixed-window' then
      for _, l in ipairs(limits) do redis.call('HDEL', state_key, fw_next(l)) end
    end
  end
  redis.call('DEL', reserved_key)
  return released
end

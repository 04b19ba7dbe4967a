-- @include states
-- reservations: the seller's reserved set (sorted set: member = held_name(TOKEN, COST), score =
-- SLOT): how a reservation is named, held, how late it may be redeemed, and pruned when it can
-- no longer be (its units given back, see give_back).
-- Defines: held_name, held_parts, MAX_RESERVED, SLOW_LINK_LATE, lateness, hold_reservation,
--   log_crowded, reserved_full

-- How a reservation of COST units is named in the seller's reserved set: TOKEN+COST. Redeeming
-- needs both, so a reservation is bound to its entry and to its weight.
local function held_name(token, cost)
  return token .. '+' .. cost
end

-- The TOKEN and COST of a reserved set's member (see held_name).
local function held_parts(member)
  local token, cost = string.match(member, '^([%w-]+)%+(%d+)$')
  return token, tonumber(cost)
end

-- Most slots a seller holds reserved at once: beyond them, a waiting caller is told when to come
-- back without a slot (far_ticket), so a seller's state stays bounded however deep its backlog.
local MAX_RESERVED = 3072

-- How late past its slot a reservation may still be redeemed (µs). The exact algorithms check
-- every grant against the calls of the last window (calls_gate), so a late call cannot break
-- their limit: a message late for its slot (it waited for a worker, the broker was slow) is
-- still served up to one window + guard late (the shortest of the stack), and SLOW_LINK_LATE
-- more: each time the gate answers "early" because the last window's calls are not answered
-- yet, the message's next try costs it a round trip to Redis, which through a slow link (half a
-- second) would otherwise make it late by the gate's own doing, again and again. The others
-- count the call at its slot only: GUARD/2 (the smallest of the stack).
local SLOW_LINK_LATE = 2000000
local function lateness(algorithm, limits)
  if algorithm == 'sliding-window' or algorithm == 'gcra' then
    return limits.min_span + SLOW_LINK_LATE
  end
  return math.floor(limits.min_guard / 2)
end

-- A reserved slot is bound to its TOKEN and COST: the seller's reserved set (member
-- held_name(TOKEN, COST), score SLOT) holds every reservation not yet redeemed, and redeem.lua
-- consumes the entry, so a reservation is good once, and only for the caller that holds its
-- token. An entry more than LATE past its slot (see lateness) can no longer be redeemed:
-- reserved_full prunes it before every new reservation, and the set expires LATE after its last
-- slot.
local function hold_reservation(key, token, cost, slot, now, late)
  -- (reserved_full has just pruned the entries more than LATE past their slot.)
  redis.call('ZADD', key, slot, held_name(token, cost))
  local last = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
  redis.call('PEXPIRE', key, math.floor((last - now + late) / 1000) + 1)
end

-- sliding-window: whether a reservation of COST more units would take the seller's log (KEY,
-- one member per unit) past MAX_RESERVED units beyond the most a window may hold. At one unit a
-- call the reserved set fills first; with costs this bounds the log, and so the seller's memory,
-- to MAX_RESERVED + the largest COUNT + COST members however deep its backlog.
local function log_crowded(key, limits, cost)
  return redis.call('ZCARD', key) + cost > MAX_RESERVED + limits.max_count
end

-- Whether the seller's reserved set is full (see MAX_RESERVED), once entries that can no longer
-- be redeemed (more than LATE past their slot, see lateness) are pruned. No call was made with
-- a pruned entry (redeeming removes it first), so its units go back to ALGORITHM's state
-- STATE_KEY (see give_back): a message that never came back for its slot (lost with a replica,
-- a refused publish) costs the seller no capacity beyond its slot.
local function reserved_full(reserved_key, now, late, state_key, algorithm, limits)
  local stale = redis.call('ZRANGEBYSCORE', reserved_key, '-inf', string.format('%.0f', now - late), 'WITHSCORES')
  for i = 1, #stale, 2 do
    local token, cost = held_parts(stale[i])
    give_back(algorithm, state_key, token, cost, tonumber(stale[i + 1]), limits)
  end
  redis.call('ZREMRANGEBYSCORE', reserved_key, '-inf', string.format('%.0f', now - late))
  return redis.call('ZCARD', reserved_key) >= MAX_RESERVED
end

-- @include reservations
-- @include routes
-- @include units
-- ranks: a waiting message's place among its seller's reservations (priority, deadline,
-- arrival), read from the token its reservation was made with, and giving way to a message
-- ranked ahead (give_way), within the seller's give-way budget.
-- Defines: MAX_PRIORITY, AGING_US, rank_of, effective, matured, ranked_behind, GIVE_WAY_REACH,
--   GIVE_WAY_STEPS_PER_S, GIVE_WAY_STEPS_SAVED, STEP_US, spent_until, spend_steps, give_way

-- The highest priority (domain::Priority::MAX in Rust; src/permit/scripts.rs checks that they
-- are equal): a token carries it as one digit.
local MAX_PRIORITY = 9

-- How long a waiting message waits for each priority level it rises (µs): after MAX_PRIORITY of
-- these, no message that came later passes it (permit::AGING in Rust; checked equal).
local AGING_US = 60000000

-- The rank a token carries: `<random>-r<P>-<DEADLINE_MS>-<ARRIVAL_MS>` (DEADLINE_MS 0 = none),
-- as {priority, deadline (µs or nil), arrival (µs or nil)}; a token without one (made by an
-- older replica, or by a caller that gave none) ranks as priority 0, no deadline, arrived last.
local function rank_of(token)
  local p, d, a = string.match(token, '%-r(%d)%-(%d+)%-(%d+)$')
  if p == nil then return {priority = 0} end
  local deadline = tonumber(d)
  if deadline == 0 then deadline = nil else deadline = deadline * 1000 end
  return {priority = tonumber(p), deadline = deadline, arrival = tonumber(a) * 1000}
end

-- The priority R has at NOW: one level more for every AGING_US it has waited, at most
-- MAX_PRIORITY.
local function effective(r, now)
  if r.arrival == nil then return r.priority end
  local aged = math.floor(math.max(0, now - r.arrival) / AGING_US)
  return math.min(MAX_PRIORITY, r.priority + aged)
end

-- Whether R has waited long enough that no message arriving after it is ranked ahead of it:
-- MAX_PRIORITY levels of aging (AGING_US each).
local function matured(r, now)
  return r.arrival ~= nil and now - r.arrival >= MAX_PRIORITY * AGING_US
end

-- Whether a message of rank B is ranked behind one of rank A at NOW. A matured message (see
-- matured) is behind no message that arrived after it, and ahead of every one; the matured are
-- the earliest arrivals, so among the others: a lower effective priority, then a later deadline
-- (none is latest), then a later arrival (unknown is latest).
local function ranked_behind(b, a, now)
  local ma, mb = matured(a, now), matured(b, now)
  if ma or mb then
    if ma and mb then return b.arrival > a.arrival end
    return ma
  end
  local pa, pb = effective(a, now), effective(b, now)
  if pb ~= pa then return pb < pa end
  local da, db = a.deadline or math.huge, b.deadline or math.huge
  if db ~= da then return db > da end
  return (b.arrival or math.huge) > (a.arrival or math.huge)
end

-- Most reservations one give-way reads, and most units it moves (permit::GIVE_WAY_REACH in Rust;
-- checked equal): those right before the new message's slot. Each move is a write (one member
-- of the reserved set, COST members of a sliding-window log), so this bounds one call's work to
-- about half a millisecond however deep the seller's backlog (up to MAX_RESERVED); a priority
-- message passes at most this many reservations when it reserves.
local GIVE_WAY_REACH = 256

-- A seller's give-way budget: steps a second (a reservation read or a unit moved is one step),
-- and most steps saved (permit::GIVE_WAY_STEPS_PER_SECOND and GIVE_WAY_STEPS_SAVED in Rust;
-- checked equal). Redis runs one script at a time, and a replica sends its workers' acquires in one
-- batch script: without it, a seller's flood of priority messages would make every other seller
-- wait for its moves. A step costs Redis about a microsecond: about a millisecond a second per
-- seller at most, and two in one batch (enough for a few priority messages at once behind a
-- backlog of a few hundred).
local GIVE_WAY_STEPS_PER_S = 1024
local GIVE_WAY_STEPS_SAVED = 2048
local STEP_US = 1000000 / GIVE_WAY_STEPS_PER_S

-- When the seller's give-way budget (BUDGET_KEY, a string: the Redis time in µs until which its
-- steps are spent) is spent until, at NOW at the earliest.
local function spent_until(budget_key, now)
  local at = tonumber(redis.call('GET', budget_key) or '')
  if at == nil or at < now then return now end
  return at
end

-- Spends STEPS of the budget (BUDGET_KEY) spent until AT: the key lasts until it is all back.
local function spend_steps(budget_key, at, steps, now)
  if steps <= 0 then return end
  at = at + steps * STEP_US
  redis.call('SET', budget_key, string.format('%.0f', at), 'PX', math.floor((at - now) / 1000) + 1)
end

-- A message (TOKEN, COST) with a priority or a deadline has just reserved SLOT in the seller's
-- reserved set RESERVED_KEY at the end of its schedule. It reads the reservations between FROM
-- (NOW, or the end of a pause: the earliest a call may be made) and SLOT, latest first, at most
-- its reach: GIVE_WAY_REACH, or half of what its seller's give-way budget BUDGET_KEY has left
-- (see GIVE_WAY_STEPS_PER_S), whichever is less. Among them, those of the same COST ranked behind
-- it at NOW, from the latest, up to the reach in units (at least one), move back one place each:
-- each takes the slot of the next one ranked behind, the latest takes SLOT, and the message takes
-- the earliest one's slot. The reserved set holds the same slots as before, in another order, and
-- so does the sliding-window log LOG_KEY (given for sliding-window: the units of each token move
-- with it); the other algorithms keep no slot per token. So no window holds more units than it
-- did. Nothing moves when that earliest slot is after the message's deadline (it expires
-- anyway), or when the budget is spent. The reservations read and the units moved are spent
-- from the budget. A reservation on a route (see routed) is never moved: its units in the
-- route's log keep their slot. A message without a priority or a deadline never moves others,
-- nor reads or spends anything (a backlog re-reserving after its slots were given back costs no
-- scan). Returns the message's slot. A moved message learns its new slot when it comes back for
-- the old one (see redeem.lua, status 9).
local function give_way(reserved_key, log_key, budget_key, token, cost, slot, now, from)
  local me = rank_of(token)
  if me.priority == 0 and me.deadline == nil then return slot end
  local spent = spent_until(budget_key, now)
  local left = GIVE_WAY_STEPS_SAVED - (spent - now) / STEP_US
  local reach = math.min(GIVE_WAY_REACH, math.floor(left / 2))
  if reach < 1 then return slot end
  local held = redis.call('ZREVRANGEBYSCORE', reserved_key, '(' .. string.format('%.0f', slot),
    '(' .. string.format('%.0f', from), 'WITHSCORES', 'LIMIT', 0, reach)
  local read = #held / 2
  -- Latest first.
  local behind, units = {}, 0
  for i = 1, #held, 2 do
    local other, other_cost = held_parts(held[i])
    if other ~= nil and other_cost == cost and not routed(other)
      and ranked_behind(rank_of(other), me, now) then
      if units > 0 and units + cost > reach then break end
      behind[#behind + 1] = {token = other, slot = tonumber(held[i + 1])}
      units = units + cost
    end
  end
  local first = behind[#behind]
  if first == nil or (me.deadline ~= nil and first.slot > me.deadline) then
    spend_steps(budget_key, spent, read, now)
    return slot
  end
  spend_steps(budget_key, spent, read + units, now)
  -- One variadic ZADD per key: each reservation ranked behind at the next one's slot.
  local moves, log_units = {}, {}
  local function move(t, to)
    local score = string.format('%.0f', to)
    moves[#moves + 1] = score
    moves[#moves + 1] = held_name(t, cost)
    if log_key ~= nil then
      for i = 1, cost do
        log_units[#log_units + 1] = score
        log_units[#log_units + 1] = unit(t, i)
      end
    end
  end
  for i = 1, #behind do
    local to = slot
    if i > 1 then to = behind[i - 1].slot end
    move(behind[i].token, to)
  end
  move(token, first.slot)
  for at = 1, #moves, 1000 do
    redis.call('ZADD', reserved_key, 'XX', unpack(moves, at, math.min(at + 999, #moves)))
  end
  for at = 1, #log_units, 1000 do
    redis.call('ZADD', log_key, 'XX', unpack(log_units, at, math.min(at + 999, #log_units)))
  end
  return first.slot
end

-- @include args
-- @include limits
-- @include pauses
-- @include ranks
-- @include losses
-- @include reservations
-- @include shadow
-- acquire: what the four acquire scripts (sliding_window.lua, gcra.lua, token_bucket.lua,
-- fixed_window.lua) share: their common arguments, when a call may be slotted (a pause, the
-- downstream's quota), how a slot is answered, and their last step.
-- Defines: acquire_args, never, due, not_before, take_quota, told_to_wait, keep_and_hold

-- The common arguments of the acquire scripts (see each script's header).
local function acquire_args(algorithm)
  local a = {
    algorithm = algorithm, state = KEYS[1],
    limits = limits_arg(1), guard = int_arg(3, -1),
    flags = int_arg(4, 0), horizon = int_arg(5, 0),
  }
  if a.flags > 7 then error({err = 'ERR turnstile: FLAGS must be 0 to 7'}) end
  a.token = token_arg(6)
  a.bound = int_arg(7, 0)
  a.cost = int_arg(8, 1)
  if a.cost > MAX_COST then error({err = 'ERR turnstile: COST must be at most ' .. MAX_COST}) end
  a.reserve = a.flags % 2
  a.durable = math.floor(a.flags / 2) % 2 == 1
  -- The keys every acquire script takes after its own seven (see sliding_window.lua).
  if a.flags >= 4 then a.learned = KEYS[8] end
  a.shadow, a.shadow_log, a.losses = KEYS[9], KEYS[10], KEYS[11]
  a.give_way, a.done = KEYS[12], KEYS[13]
  if a.give_way == nil then error({err = 'ERR turnstile: KEYS[12] must be the give-way budget'}) end
  return a
end

-- The answer of the acquire scripts to a call whose cost the seller's limits can never grant
-- (more than MAX units at once): status 4, nothing written.
local function never(max, now, limits)
  return {4, max, now, limits.counts, limits.windows}
end

-- The answer of the acquire scripts, shared so that they decide alike:
-- granted if the slot is due within EARLY (guard/10), else reserved, or denied when reserving
-- is off or the slot lies beyond the horizon.
local function due(slot, now, guard, a)
  local wait = slot - now
  if wait <= math.floor(guard / 10) then return 1 end
  if a.reserve == 0 or wait > a.horizon then return 0 end
  return 2
end

-- The earliest a call of COST units may be slotted: after the seller's pause (PAUSE_KEY) and,
-- when the downstream's quota (see with_learned) has fewer than COST units left, after its reset.
local function not_before(pause_key, limits, cost, now)
  local at = paused_until(pause_key)
  local u = limits.quota_until
  if u ~= nil and u > now and (limits.quota_left or 0) < cost then at = math.max(at, u) end
  return at
end

-- A call (or reservation) of COST units slotted at SLOT before the quota's reset takes its units
-- from the quota's `left` (see not_before).
local function take_quota(learned_key, limits, slot, cost, now)
  local u = limits.quota_until
  if learned_key == nil or u == nil or u <= now or slot >= u then return end
  redis.call('HINCRBY', learned_key, 'left', -cost)
end

-- The answer of the acquire scripts to a caller told to wait (STATUS 0 or 2) until SLOT.
local function told_to_wait(status, slot, now, limits, a)
  judge_shadow(a, now, false)
  return {status, slot, now, limits.counts, limits.windows, 0, a.verdict or ''}
end

-- The last step of every acquire script, once the seller's state was written to last TTL ms:
-- the server stamp STAMP_KEY lasts as long, the call (or reservation) takes its part of the
-- downstream's quota (take_quota), and a wait (STATUS 2) holds its reservation in RESERVED_KEY.
-- Returns the script's answer for a wait, nil for a grant (judged by the shadow limit).
local function keep_and_hold(status, ttl, stamp_key, reserved_key, slot, now, late, a, limits)
  keep_stamp(stamp_key, ttl, a.durable)
  take_quota(a.learned, limits, slot, a.cost, now)
  if status ~= 2 then
    judge_shadow(a, now, true)
    return nil
  end
  hold_reservation(reserved_key, a.token, a.cost, slot, now, late)
  -- A message with a priority or a deadline goes ahead of those ranked behind it (ranks.lua).
  local log_key = nil
  if a.algorithm == 'sliding-window' then log_key = a.state end
  local from = math.max(now, not_before(KEYS[3], limits, a.cost, now))
  slot = give_way(reserved_key, log_key, a.give_way, a.token, a.cost, slot, now, from)
  return told_to_wait(2, slot, now, limits, a)
end

-- @include calls
-- blocks: permit blocks (sliding-window): units taken at once into the seller's pool (sorted
-- set BLOCKED_KEY: unit -> its END) for its next calls by any replica, claimed one by one, and
-- taken back when the seller gets near its limits or its terms change.
-- Defines: MAX_BLOCK, MAX_HOLD_US, block_unit, take_block, claim_idle, reclaim_idle

-- Most units of a permit block (see take_block) besides the call that asks for it
-- (permit::block::MOST_UNITS in Rust; src/permit/scripts.rs checks that they are equal).
local MAX_BLOCK = 64

-- Longest HOLD of a permit block's units (µs; permit::BLOCK_HOLD in Rust is at most this).
local MAX_HOLD_US = 60000000

-- The name of unit I of the permit block of the call TOKEN: a call of its own, of one unit, in
-- the seller's log and calls (see take_block); unit 1 is the call TOKEN itself.
local function block_unit(token, i)
  if i == 1 then return token end
  return token .. '-' .. i
end

-- Permit blocks (sliding-window): a call of one unit granted now (TOKEN, already in the log and
-- in flight) may take up to WANT more units at once into the seller's pool of unclaimed units
-- (BLOCKED_KEY, score = the unit's END, NOW + HOLD + BOUND), for the next calls of the seller by
-- any replica: each is claimed (taken out of the pool) by an acquire (claim_idle) or by a
-- replica's plain ZPOPMIN, and used only if the claimer's call, bounded from before its claim
-- by its own BOUND, answers by END (the acquire checks on Redis's clock; a plain claim on
-- Redis's TIME read in the same pipeline, after the call was asked for).
-- Only while the seller is far from its limits: no reservation waiting (RESERVED_KEY empty), no
-- shadow limit, no learned limit or quota applying (see with_learned), and, for every limit of
-- the stack, the units in the log within its span and the calls of the calls gate within its
-- window (see calls_gate), block included, at most half its COUNT; the second half is granted
-- call by call, with reservations, as before. A block is at most a quarter of every COUNT (a
-- stack with a COUNT below 8 takes none). Each unit (block_unit(TOKEN, I)) is in the log at NOW
-- and in flight in the calls until NOW + HOLD + BOUND, the latest a call made with it can
-- answer (keep_calls: the calls set lives at least as long): the
-- calls gate counts it, wherever in that time it is used, exactly as a call of that latency
-- (docs/performance.md, "Permit blocks"). Until it is claimed, an acquire short of room may reclaim it
-- (reclaim_idle): units no one uses never keep a call waiting. Returns how many units were
-- taken (0: none).
local function take_block(a, limits, log_key, reserved_key, calls_key, blocked_key, now, want, hold)
  if want < 1 or a.cost ~= 1 or limits.configured ~= nil or limits.quota_until ~= nil then return 0 end
  if redis.call('EXISTS', reserved_key) == 1 then return 0 end
  if a.shadow ~= nil and redis.call('EXISTS', a.shadow) == 1 then return 0 end
  local n = math.min(want, MAX_BLOCK)
  if limits.min_count < 8 then return 0 end
  for _, l in ipairs(limits) do
    -- As the grant counted them (l.logged, l.in_flight: see fit and calls_gate), with it.
    local logged = l.logged or redis.call('ZCOUNT', log_key, string.format('(%.0f', now - l.span), '+inf')
    local calls = l.in_flight or redis.call('ZCOUNT', calls_key, string.format('(%.0f', now - l.window), '+inf')
    n = math.min(n, math.floor(l.count / 4), math.floor(l.count / 2) - math.max(logged, calls) - 1)
  end
  if n < 1 then return 0 end
  local logged, in_flight, idle = {}, {}, {}
  local ends = string.format('%.0f', now + hold + a.bound)
  for i = 2, n + 1 do
    local unit = block_unit(a.token, i)
    logged[#logged + 1] = now
    logged[#logged + 1] = unit
    in_flight[#in_flight + 1] = ends
    in_flight[#in_flight + 1] = unit
    idle[#idle + 1] = ends
    idle[#idle + 1] = unit
  end
  redis.call('ZADD', log_key, unpack(logged))
  redis.call('ZADD', calls_key, unpack(in_flight))
  keep_calls(calls_key, hold + a.bound + limits.max_window)
  redis.call('ZADD', blocked_key, unpack(idle))
  -- The pool outlives the hold (by the longest span or the bound, if longer): a later acquire
  -- gives back the units no call used (claim_idle); the last ones leave the log by themselves.
  local pool_ttl = math.floor((hold + math.max(limits.max_span, a.bound)) / 1000) + 1
  if redis.call('PTTL', blocked_key) < pool_ttl then redis.call('PEXPIRE', blocked_key, pool_ttl) end
  return n
end

-- Claims a unit of the seller's pool (BLOCKED_KEY, see take_block) for a call asked for before
-- NOW that answers within BOUND of being asked for: first every unit that such a call could
-- outlive (END < NOW + BOUND: its hold is over) is given back (it leaves the pool, the log and
-- the calls), then the unit that ends first is taken out of the pool; the call answers by its
-- END. Returns the unit (nil: none) with its END, and how many stale units were given back.
local function claim_idle(blocked_key, log_key, calls_key, now, bound)
  local stale = redis.call('ZRANGEBYSCORE', blocked_key, '-inf', string.format('(%.0f', now + bound))
  for first = 1, #stale, 1000 do
    local last = math.min(first + 999, #stale)
    redis.call('ZREM', blocked_key, unpack(stale, first, last))
    redis.call('ZREM', log_key, unpack(stale, first, last))
    redis.call('ZREM', calls_key, unpack(stale, first, last))
  end
  local next = redis.call('ZPOPMIN', blocked_key)
  if #next == 0 then return nil, 0, #stale end
  return next[1], tonumber(next[2]), #stale
end

-- Takes back every permit-block unit of the seller not claimed yet (BLOCKED_KEY, see
-- take_block): they leave the log and the calls, and a replica's claim of one now fails (it
-- asks again instead). Returns how many were taken back.
local function reclaim_idle(blocked_key, log_key, calls_key)
  if blocked_key == nil then return 0 end
  local idle = redis.call('ZRANGE', blocked_key, 0, -1)
  if #idle == 0 then return 0 end
  redis.call('DEL', blocked_key)
  for first = 1, #idle, 1000 do
    local last = math.min(first + 999, #idle)
    redis.call('ZREM', log_key, unpack(idle, first, last))
    redis.call('ZREM', calls_key, unpack(idle, first, last))
  end
  return #idle
end

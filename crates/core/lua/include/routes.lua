-- @include args
-- @include fit
-- @include limits
-- @include terms
-- @include units
-- routes: a call on a route (one endpoint of the routes file) takes units of its route's own
-- per-seller stack and of the seller's budget (the script's stack) in the same step. The route's
-- log (sorted set: the units of each TOKEN, score = slot, as the seller's sliding-window log)
-- holds the units of the route's calls and reservations; a slot is granted or reserved only
-- where both stacks allow it, and written to both logs, so neither ever holds a slot the other
-- refused. A route's stack holds sliding windows and calendar limits, as the seller's does.
-- A route's calls are the seller's calls (the same members in the seller's calls, see
-- calls_gate): the route keeps no calls of its own, and a call's answer ends it for both.
-- A route's token ends with `-q` (see routed): it neither gives way nor is moved by a message
-- ranked ahead (include/ranks.lua), since its units in the route's log keep their slot.
-- Defines: routed, route_arg, route_reach, route_trim, route_fit, route_gate, route_add

-- Whether TOKEN was made for a call on a route.
local function routed(token)
  return string.sub(token, -2) == '-q'
end

-- The route section of a script's arguments, or nil when ARGV[i] is absent: ARGV[i] and
-- ARGV[i + 1] are the route's stack from the routes file (COUNTS and WINDOWS in µs), LOG_KEY the
-- route's log and OVERRIDE_KEY its override for the seller ("COUNTS WINDOWS_US", may be absent:
-- `turnstile limits set --route`). GUARD as in guard_for; COST the call's units.
local function route_arg(i, log_key, override_key, guard, cost)
  if ARGV[i] == nil then return nil end
  local default = limits_arg(i)
  if log_key == nil or override_key == nil then
    error({err = 'ERR turnstile: a route needs its log and its override in KEYS'})
  end
  local limits = with_spans(effective_limits(override_key, default, nil, cost), guard)
  return {log = log_key, limits = limits}
end

-- How far back (µs) the route's log must reach at NOW: a call granted up to LATE after its slot
-- answers up to BOUND after its grant, and counts in every window its answer may fall in.
local function route_reach(route, bound, late)
  return route.limits.max_span + bound + late
end

-- Drops the units of the route's log that no window of its stack can count any more.
local function route_trim(route, now, bound, late)
  redis.call('ZREMRANGEBYSCORE', route.log, '-inf', now - route_reach(route, bound, late))
end

-- The earliest slot from SLOT at which the route's log leaves room for COST more units under
-- every limit of the route's stack (see stack_fit and, without a calendar limit, gap_fit). The
-- caller takes the latest of this and the seller's slot, until both agree.
local function route_fit(route, slot, now, cost, zone, after)
  local from = slot
  slot = stack_fit(route.log, route.limits, slot, now, cost, zone, after)
  if route.limits.has_calendar then return slot end
  return gap_fit(route.log, route.limits, from, slot, cost)
end

-- calls_gate for the route's stack: a call of COST units (TOKEN) may start now only while, for
-- every limit of the route, the route's calls whose END lies within its window leave room for
-- COST more. A unit of the route's log slotted by NOW + EARLY (a grant may come EARLY before its
-- slot) is a call if the seller's calls (CALLS_KEY) hold it, with its END there; one they do not
-- hold is a reservation not yet redeemed (no call), unless it was slotted before NOW - KEPT (the
-- seller's calls keep every call whose END lies within their longest window, KEPT): then it may
-- be a call whose END was before NOW - KEPT, and counts as one that ended then. Units of TOKEN
-- itself (a reservation being redeemed) are not counted. Returns nil when the call may start
-- now, else when to ask again (as calls_gate).
local function route_gate(route, calls_key, token, cost, now, early, bound, late, kept)
  local limits = route.limits
  local units = redis.call('ZRANGEBYSCORE', route.log,
    string.format('(%.0f', now - route_reach(route, bound, late)),
    string.format('%.0f', now + early), 'WITHSCORES')
  if #units / 2 + cost <= limits.min_count then return nil end
  local ends = {}
  for i = 1, #units, 2 do
    local member = units[i]
    if string.match(member, '^[%w-]+') ~= token then
      local e = tonumber(redis.call('ZSCORE', calls_key, member))
      if e == nil and tonumber(units[i + 1]) <= now - kept then e = now - kept end
      if e ~= nil then ends[#ends + 1] = e end
    end
  end
  table.sort(ends, function(x, y) return x > y end)
  local open_at, in_flight = nil, false
  for _, l in ipairs(limits) do
    local room = l.count - cost
    local kth = ends[room + 1]
    if l.phase == nil and kth ~= nil and kth > now - l.window then
      open_at = math.max(open_at or 0, kth + l.window)
      if kth > now then in_flight = true end
    end
  end
  if open_at == nil or not in_flight then return open_at end
  return math.min(open_at, now + math.max(limits.min_guard, 25000))
end

-- Writes the COST units of TOKEN at SLOT to the route's log, kept as long as its windows may
-- count them.
local function route_add(route, slot, token, cost, now, bound, late)
  add_units(route.log, slot, token, cost)
  local last = tonumber(redis.call('ZRANGE', route.log, -1, -1, 'WITHSCORES')[2])
  redis.call('PEXPIRE', route.log, math.floor((last - now + route_reach(route, bound, late)) / 1000) + 1)
end

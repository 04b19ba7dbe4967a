-- @include args
-- @include blocks
-- @include learned
-- @include limits
-- @include reservations
-- @include states
-- @include terms
-- @include terms_change
-- @include time
-- @include units
-- learn: adaptive limits. What the downstream's answers say about its real limit for a seller
-- lowers (or raises again) the counts of the seller's configured stack, within
-- [min(MIN, COUNT), COUNT] for each limit, in the seller's learned state, which every replica's
-- acquire applies at once (see with_learned in include/terms.lua). EVENT is one of:
--   throttled  a 429 for a call granted at GRANTED, at or after the last change: the limit the
--              downstream most likely counted (the one whose window holds the most accepted
--              units for its learned count) goes down to what the downstream accepted in that
--              window (multiplicative decrease, see lowered_count; to half when it accepted
--              that count in full, or nothing yet: no evidence); after a raise (a failed probe)
--              the patience of the next raise doubles (at most 64 windows). A 429 for a call
--              granted before the last change (one of the same burst) only corrects the
--              decrease, as below.
--   recovery   first, a count the last 429 lowered is corrected to what the downstream is now
--              seen to have accepted in the window of that 429 (see corrected_count and
--              evidence_of: its answers come back in any order, and a 2xx is recorded after
--              its result is published); else the downstream accepted a learned count in full
--              over PATIENCE windows (see raise_due): each such limit goes up by a twentieth of
--              its configured count (at least 1; additive increase), never above it. A header
--              event without a LIMIT does the same.
--   header     rate-limit headers of any answer (a 429 too): LIMIT per WINDOW sets each limit's
--              count (see below) as the truth, up or down; REMAINING units until RESET become
--              the downstream's quota (see not_before in include/acquire.lua), shared by every
--              replica.
--              A throttled event whose headers carry a LIMIT learns from the headers only.
-- LIMIT maps onto a configured limit of window W as: LIMIT if W equals WINDOW or is shorter;
-- LIMIT * W / WINDOW (rounded down) if W is longer; without WINDOW, WINDOW is the stack's
-- shortest. The quota's REMAINING is reduced by the seller's units in flight at the answer or
-- granted since (calls whose end lies after it: the exact algorithms track them) and its units
-- reserved before the reset; an
-- answer for the same reset (within 1 s) can only lower what is left.
-- A change of the counts that apply gives back every reserved slot at once and wakes their
-- holders (as an operator's change does, see give_back_reserved in include/terms_change.lua), so
-- the whole backlog follows the new counts: a lowered one at once, a raised one too (a backlog
-- reserved under the lower counts would otherwise drain at their pace); except after a failed
-- probe (see give_back_since_raise). The state lives for learned_ttl after its last change or
-- accepted answer (see complete.lua).
--
-- KEYS[1]  the seller's learned state (hash: terms, counts, from, at, why, patience, mark, left,
--          until)
-- KEYS[2]  the seller's accepted log (see note_accepted in include/learned.lua)
-- KEYS[3]  the seller's limit override ("COUNTS WINDOWS_US"), may be absent
-- KEYS[4]  the seller's limiter state for ALGORITHM
-- KEYS[5]  the seller's reserved slots (sorted set: member = held_name(TOKEN, COST), score = slot)
-- KEYS[6]  the seller's calls (see calls_gate in include/calls.lua)
-- KEYS[7]  sliding-window, optional: the seller's pool of unclaimed permit-block units (see
--          take_block): whenever the state is written, they are taken back (reclaim_idle), so
--          no unit granted before the lesson is claimed after it
-- KEYS[-n] with ROUTES = n (sliding-window, after KEYS[7]): the seller's logs of the routes, the
--          last n keys (see include/routes.lua): a reservation on a route given back leaves its
--          route's log too
-- ARGV[1]  ALGORITHM: sliding-window, gcra, token-bucket or fixed-window
-- ARGV[2]  default COUNTS, comma-separated (integers >= 1; 1 to 8 limits)
-- ARGV[3]  default WINDOWS in µs, comma-separated, one per count (integers >= 1)
-- ARGV[4]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- ARGV[5]  gcra: BURST (integer >= 1); others: ignored
-- ARGV[6]  token-bucket: CAPACITY (integer >= 0; see with_capacities); others: ignored
-- ARGV[7]  MIN: the lowest a learned count goes (integer >= 1; a COUNT below it is kept)
-- ARGV[8]  EVENT: throttled, recovery or header
-- ARGV[9]  GRANTED in µs (Redis time): throttled: when the throttled call was granted; recovery
--          and header: when the answer came back (0 = now; see answered_arg in include/args.lua): a
--          raise is judged, and a quota's RESET counted, from then (integer >= 0)
-- ARGV[10] LIMIT from headers (integer >= 1; -1 = none)
-- ARGV[11] WINDOW in µs from headers (integer >= 1; -1 = none)
-- ARGV[12] REMAINING from headers (integer >= 0; -1 = none)
-- ARGV[13] RESET in µs from now, from headers (integer >= 0; -1 = none)
-- ARGV[14] optional ROUTES: how many of the last keys are the seller's logs of the routes
--          (integer >= 0; absent = 0)
-- Returns {CHANGED, RELEASED, NOW_US, COUNTS, WHY, CONFIGURED, WAKE, LOWERED}: CHANGED 1 when the counts
-- that apply changed; RELEASED how many reservations were given back; COUNTS the learned counts
-- now; WHY the last change's reason (429, recovery, header) or ''; CONFIGURED the configured
-- stack's counts; WAKE 1 when every reservation was given back (their holders should come back
-- now: announce it), else 0; LOWERED 1 when a count went down, else 0.

local algorithm = algorithm_arg(1)
local default = limits_arg(2)
local guard = int_arg(4, -1)
local burst = int_arg(5, 1)
local capacity = int_arg(6, 0)
local min = int_arg(7, 1)
local event = ARGV[8]
if event ~= 'throttled' and event ~= 'recovery' and event ~= 'header' then
  error({err = 'ERR turnstile: EVENT must be throttled, recovery or header'})
end
local granted = int_arg(9, 0)
local limit, window = int_arg(10, -1), int_arg(11, -1)
local remaining, reset = int_arg(12, -1), int_arg(13, -1)
local route_logs = {}
if ARGV[14] ~= nil then
  local routes = int_arg(14, 0)
  if routes > 0 and #KEYS - routes < 7 then
    error({err = 'ERR turnstile: ROUTES follow the seven keys of sliding-window'})
  end
  for i = #KEYS - routes + 1, #KEYS do route_logs[#route_logs + 1] = KEYS[i] end
end
if limit == 0 or window == 0 then
  error({err = 'ERR turnstile: LIMIT and WINDOW must be >= 1 or -1'})
end

local configured = with_spans(effective_limits(KEYS[3], default), guard)
local before = with_capacities(with_spans(effective_limits(KEYS[3], default, KEYS[1], 1), guard), capacity)
local now = now_us()
-- When the answer taught it (a lesson may ride along with other calls for a while).
local as_of = now
if event ~= 'throttled' and granted > 0 then as_of = math.min(granted, now) end
local st = learned_state(KEYS[1], configured)
local counts = {}
for i, c in ipairs(st.counts) do counts[i] = c end
local why = nil
local function floor_of(i)
  return math.min(min, configured[i].count)
end

if limit >= 1 then
  local w = window
  if w < 1 then w = configured[1].window end
  for i, l in ipairs(configured) do
    local n = limit
    if l.window > w then n = math.floor(limit * l.window / w) end
    n = math.max(floor_of(i), math.min(l.count, n))
    if n ~= counts[i] then
      counts[i] = n
      why = 'header'
    end
  end
elseif event == 'throttled' and granted >= st.at then
  local b, most, accepted = 1, -1, {}
  for i, l in ipairs(configured) do
    accepted[i] = accepted_in(KEYS[2], l.window, now)
    if accepted[i] / counts[i] > most then b, most = i, accepted[i] / counts[i] end
  end
  local lowered = lowered_count(counts[b], accepted[b], floor_of(b))
  if lowered < counts[b] then
    if st.why == 'recovery' then st.patience = math.min(st.patience * 2, 64) end
    counts[b] = lowered
    why = '429'
  end
end
-- A 429 for a call granted before the last change (one of the same burst), a recovery and a
-- header without a LIMIT first correct the last decrease to what the downstream is now seen to
-- have accepted in its window (see corrections); the decrease's reason and time stay.
-- (Nothing changed the counts before this: they are still the state's.)
local corrected = false
if why == nil and limit < 1 then
  for i, n in pairs(corrections(st, configured, KEYS[2])) do
    counts[i] = n
    corrected = true
  end
end
-- (A header without a LIMIT says nothing about the counts: sustained success still raises.)
if why == nil and not corrected and limit < 1 and event ~= 'throttled' then
  for _, i in ipairs(raise_due(st, configured, KEYS[2], as_of)) do
    local c = configured[i].count
    counts[i] = math.min(c, counts[i] + math.max(1, math.floor(c / 20)))
    why = 'recovery'
  end
end

local write = nil
if why then
  write = {'counts', csv(counts), 'from', csv(st.counts), 'at', string.format('%.0f', now),
    'why', why, 'patience', st.patience}
elseif corrected then
  write = {'counts', csv(counts)}
end
if remaining >= 0 and reset >= 0 then
  local until_us = as_of + reset
  -- (Units of calls that ended since the answer count too: the lesson may have ridden along.)
  local units = redis.call('ZCOUNT', KEYS[6], string.format('(%.0f', as_of), '+inf')
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', string.format('(%.0f', until_us))) do
    local _, cost = held_parts(member)
    units = units + cost
  end
  local left = math.max(remaining - units, 0)
  local q = redis.call('HMGET', KEYS[1], 'left', 'until')
  local old_left, old_until = tonumber(q[1]), tonumber(q[2])
  if not st.fresh and old_left and old_until and old_until > now
      and math.abs(old_until - until_us) <= 1000000 then
    left = math.min(left, old_left)
    until_us = math.max(until_us, old_until)
  end
  write = write or {'counts', csv(counts), 'patience', st.patience}
  write[#write + 1] = 'left'
  write[#write + 1] = left
  write[#write + 1] = 'until'
  write[#write + 1] = string.format('%.0f', until_us)
end

-- After a raise, a decrease back to the stack before it (a failed probe) gives back only the
-- slots reserved after MARK (with sliding-window, the log's last slot when the raise was made: a
-- reservation made while the log held units ahead is slotted after all of them). A slot the
-- raised stack reserved at or before MARK (the log had nothing ahead then) is left to redeem,
-- which refuses a slot reserved under a looser stack than the one that applies (see within) and
-- gives it back. The holders of the slots given back find them gone when they come back (redeem
-- answers 8) and reserve anew; nobody is woken. Returns how many were given back, or nil when
-- this is no failed probe (then every slot is given back).
local function give_back_since_raise(after)
  local mark = tonumber(redis.call('HGET', KEYS[1], 'mark') or '')
  if algorithm ~= 'sliding-window' or st.why ~= 'recovery' or mark == nil then return nil end
  local pre_raise = parse_limits(csv(st.from), configured.windows)
  if pre_raise == nil or not within(pre_raise, after) then return nil end
  local members = redis.call('ZRANGEBYSCORE', KEYS[5], string.format('(%.0f', mark), '+inf')
  for _, member in ipairs(members) do
    local token, cost = held_parts(member)
    give_back(algorithm, KEYS[4], token, cost, 0, after, route_logs)
    redis.call('ZREM', KEYS[5], member)
  end
  return #members
end

local changed, released, wake, lowered = 0, 0, 0, 0
if write then
  -- A state learned under other terms is dropped whole, not carried over field by field.
  if st.fresh then redis.call('DEL', KEYS[1]) end
  redis.call('HSET', KEYS[1], 'terms', configured.counts .. ' ' .. configured.windows, unpack(write))
  -- Kept at least until the quota's reset, which no accepted answer renews while it holds.
  local quota_until = tonumber(redis.call('HGET', KEYS[1], 'until') or '') or 0
  redis.call('PEXPIRE', KEYS[1], math.max(learned_ttl(configured), math.floor((quota_until - now) / 1000) + 1))
  if algorithm == 'sliding-window' then reclaim_idle(KEYS[7], KEYS[4], KEYS[6]) end
  local after = with_spans(effective_limits(KEYS[3], default, KEYS[1], 1), guard)
  if after.counts ~= before.counts then
    changed = 1
    if within(before, after) then
      released = give_back_reserved(algorithm, KEYS[4], KEYS[5], before, after, now, burst,
        route_logs)
      wake = 1
      -- The raise's mark (see give_back_since_raise): every slot reserved from now on is the
      -- raised stack's.
      local mark = now
      if algorithm == 'sliding-window' then
        mark = math.max(tonumber(redis.call('ZRANGE', KEYS[4], -1, -1, 'WITHSCORES')[2] or '') or now, now)
      end
      redis.call('HSET', KEYS[1], 'mark', string.format('%.0f', mark))
    else
      lowered = 1
      released = give_back_since_raise(after)
      if released == nil then
        released = give_back_reserved(algorithm, KEYS[4], KEYS[5], before, after, now, burst,
          route_logs)
        wake = 1
      end
    end
  end
end
return {changed, released, now, csv(counts), why or st.why, configured.counts, wake, lowered}

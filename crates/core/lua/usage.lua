-- @include args
-- @include limits
-- @include pauses
-- @include states
-- @include tats
-- @include terms
-- @include time
-- usage: how much of each limit of a seller's stack is taken now, for the dashboard. Reads only;
-- never writes. Per limit, USED of CAPACITY is what the limit counts now (the share that makes
-- the next caller wait); AHEAD is what is already promised beyond it (reserved units, debt): the
-- scheduled backlog. In units (a call of COST takes COST).
--   sliding-window: USED = units in the trailing window (+ guard), CAPACITY = COUNT,
--                   AHEAD = units reserved after now
--   gcra:           cells = ceil((TAT - now) / interval); USED = min(cells, BURST),
--                   CAPACITY = BURST, AHEAD = the other cells
--   token-bucket:   USED = tokens taken (CAPACITY - tokens now), AHEAD = debt in tokens
--   fixed-window:   USED = units of the current window, CAPACITY = COUNT,
--                   AHEAD = units reserved in later windows
--
-- KEYS[1]  the seller's limiter state for ALGORITHM (see the acquire scripts)
-- KEYS[2]  the seller's limit override ("COUNTS WINDOWS_US"), may be absent
-- KEYS[3]  the seller's pause ("UNTIL_US"), may be absent
-- KEYS[4]  the seller's learned state (see with_learned; applied with ARGV[7])
-- KEYS[5]  the seller's shadow limit (see judge_shadow in include/shadow.lua), may be absent
-- KEYS[6]  optional: the seller's calls (see calls_gate in include/calls.lua)
-- KEYS[7]  optional: the seller's reserved set (see hold_reservation in include/reservations.lua)
-- KEYS[8]  optional: the seller's accepted log (see note_accepted in include/learned.lua: the
--          units the downstream accepted, kept with adaptive limits on)
-- ARGV[1]  ALGORITHM: sliding-window, gcra, token-bucket or fixed-window
-- ARGV[2]  default COUNTS, comma-separated (integers >= 1; 1 to 8 limits)
-- ARGV[3]  default WINDOWS in µs, comma-separated, one per count (integers >= 1)
-- ARGV[4]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- ARGV[5]  gcra: BURST (integer >= 1); others: ignored
-- ARGV[6]  token-bucket: CAPACITY (integer >= 0; see with_capacities); others: ignored
-- ARGV[7]  ADAPTIVE: 1 = adaptive limits on (the learned counts apply), else 0
-- Returns {PAUSED_UNTIL_US, NOW_US, OVERRIDE, COUNTS, WINDOWS_US, then per limit of the stack in
-- its order: USED, CAPACITY, AHEAD}; COUNTS and WINDOWS_US are the stack that applies, OVERRIDE
-- is 1 when it is the seller's own (a well-formed override is set); with learned counts, COUNTS
-- are the learned ones; then CONFIGURED_COUNTS (the configured stack's counts), WHY (why the
-- learned counts last changed, or ''), and the shadow limit: its COUNTS and WINDOWS_US ('' when
-- none), AGREE, STRICTER and LOOSER; then per limit of the stack, OLDEST_AGE_US (see the end);
-- then IN_FLIGHT: units of calls granted and not answered yet (0 without KEYS[6]); then per
-- limit, DUE: reservations whose slot is in its window now and that are not redeemed yet (0
-- without KEYS[7]); then ACCEPTED and ACCEPTED_OLDEST_AGE_US: the units the downstream accepted
-- in the stack's longest window (+ guard) up to now, and how long ago the oldest of them was
-- (both 0 without KEYS[8]).

local algorithm = algorithm_arg(1)
local default = limits_arg(2)
local learned_key = nil
if int_arg(7, 0) == 1 then learned_key = KEYS[4] end
local limits = with_spans(effective_limits(KEYS[2], default, learned_key), int_arg(4, -1))
with_capacities(limits, int_arg(6, 0))
local now = now_us()
-- (An override that is not well-formed is ignored by every script: the default applies.)
local overridden = 0
if (limits.configured or limits) ~= default then overridden = 1 end
local answer = {paused_until(KEYS[3]), now, overridden, limits.counts, limits.windows}
local function row(used, capacity, ahead)
  answer[#answer + 1] = math.floor(used)
  answer[#answer + 1] = math.floor(capacity)
  answer[#answer + 1] = math.floor(ahead)
end

if algorithm == 'sliding-window' then
  local ahead = redis.call('ZCOUNT', KEYS[1], string.format('(%.0f', now), '+inf')
  for _, l in ipairs(limits) do
    row(redis.call('ZCOUNT', KEYS[1], string.format('(%.0f', now - l.span), string.format('%.0f', now)), l.count, ahead)
  end
elseif algorithm == 'gcra' then
  local burst_arg = int_arg(5, 1)
  local stored = tats_under(read_tats(redis.call('GET', KEYS[1])), limits, burst_arg, now, KEYS[7])
  for i, l in ipairs(limits) do
    local burst, interval = cell_of(l, burst_arg)
    local cells = math.ceil(math.max((stored[i] or stored.latest) - now, 0) / interval)
    row(math.min(cells, burst), burst, cells - math.min(cells, burst))
  end
elseif algorithm == 'token-bucket' then
  local fields = {'ts'}
  for i = 1, #limits do fields[i + 1] = tb_field(i) end
  local state = redis.call('HMGET', KEYS[1], unpack(fields))
  local ts = tonumber(state[1]) or now
  for i, l in ipairs(limits) do
    -- Tokens now: refilled since ts, or (ts in the future, a reservation) the debt still to pay.
    local tokens_now = math.min((tonumber(state[i + 1]) or l.capacity) + (now - ts) * l.count / l.span, l.capacity)
    row(math.ceil(l.capacity - math.max(tokens_now, 0)), l.capacity, math.ceil(math.max(-tokens_now, 0)))
  end
else
  for _, l in ipairs(limits) do
    local current = math.floor(now / l.window)
    local used = tonumber(redis.call('HGET', KEYS[1], fw_field(l, current)) or '0')
    local ahead = 0
    for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
      local w, index = string.match(field, '^(%d+):(%d+)$')
      if index and tonumber(w) == l.window and tonumber(index) > current then
        ahead = ahead + tonumber(redis.call('HGET', KEYS[1], field))
      end
    end
    row(used, l.count, ahead)
  end
end
local configured = limits.configured or limits
answer[#answer + 1] = configured.counts
answer[#answer + 1] = ''
if limits.configured then answer[#answer] = redis.call('HGET', KEYS[4], 'why') or '' end
local shadow = redis.call('HMGET', KEYS[5], 'counts', 'windows', 'agree', 'stricter', 'looser')
for i = 1, 5 do answer[#answer + 1] = shadow[i] or '' end
-- Per limit, how long ago the oldest unit it counts now was taken (µs): its window frees from
-- then on (sliding-window: the oldest entry in the trailing window; fixed-window: the current
-- window's start; others: 0).
for _, l in ipairs(limits) do
  local age = 0
  if algorithm == 'sliding-window' then
    local oldest = redis.call('ZRANGEBYSCORE', KEYS[1], string.format('(%.0f', now - l.span),
      string.format('%.0f', now), 'WITHSCORES', 'LIMIT', 0, 1)
    if oldest[2] then age = now - tonumber(oldest[2]) end
  elseif algorithm == 'fixed-window' then
    age = now - math.floor(now / l.window) * l.window
  end
  answer[#answer + 1] = math.floor(math.max(age, 0))
end
local in_flight = 0
if KEYS[6] then in_flight = redis.call('ZCOUNT', KEYS[6], string.format('(%.0f', now), '+inf') end
answer[#answer + 1] = in_flight
for _, l in ipairs(limits) do
  local due = 0
  if KEYS[7] then
    due = redis.call('ZCOUNT', KEYS[7], string.format('(%.0f', now - l.span), string.format('%.0f', now))
  end
  answer[#answer + 1] = due
end
local accepted, accepted_age = 0, 0
if KEYS[8] then
  local longest = 0
  for _, l in ipairs(limits) do longest = math.max(longest, l.span) end
  local since = string.format('(%.0f', now - longest)
  accepted = redis.call('ZCOUNT', KEYS[8], since, '+inf')
  local oldest = redis.call('ZRANGEBYSCORE', KEYS[8], since, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if oldest[2] then accepted_age = math.max(now - tonumber(oldest[2]), 0) end
end
answer[#answer + 1] = accepted
answer[#answer + 1] = math.floor(accepted_age)
return answer

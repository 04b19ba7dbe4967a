-- @include limits
-- @include reservations
-- tats: gcra's state of a seller, one theoretical arrival time (TAT, µs, Redis time) per limit
-- of the stack that wrote it, kept with that stack ("TAT1,TAT2,#C1;C2#W1;W2": the stack's counts
-- and windows after a `#` each, `;`-separated, so that a reader of the form before, which split
-- on commas, reads the TATs and takes the last field for none), and how a state written under
-- one stack is read under another (a fleet's terms raised or lowered, an override, a learned
-- count). A state without its stack ("TAT1,TAT2", written before it was kept) is read by
-- position under whatever stack applies.
-- Defines: cell_of, stack_sign, read_tats, tats_text, written_under, units_after, cells_ahead,
--   spaced, tats_under

-- gcra's burst and emission interval for the limit L with BURST: B = min(BURST, COUNT), and
-- (WINDOW + GUARD) / (COUNT - B + 1) µs (see gcra.lua).
local function cell_of(l, burst)
  local b = math.min(burst, l.count)
  return b, l.span / (l.count - b + 1)
end

-- The stack LIMITS as a state keeps it: its counts and windows, `;`-separated. With learned
-- counts, those a call of cost 1 gets (see with_learned: a costlier call may get a higher
-- count, which is not another stack).
-- Worked out once per stack (kept in LIMITS as `signed`).
local function stack_sign(limits)
  if limits.signed == nil then
    local counts = limits.sign_counts or limits.counts
    limits.signed = {(string.gsub(counts, ',', ';')), (string.gsub(limits.windows, ',', ';'))}
  end
  return limits.signed[1], limits.signed[2]
end

-- The state in VALUE (a GET's answer: nil or false when there is none): its TATs by position
-- (unreadable ones 0), `latest` (the latest of them, 0 when none) and, when it says, the stack's
-- `counts` and `windows` (as stack_sign gives them).
local function read_tats(value)
  local state = {latest = 0}
  local text = value or ''
  local tats, counts, windows = string.match(text, '^(.-),?#([%d;]+)#([%d;@]+)$')
  if tats then
    state.counts, state.windows = counts, windows
  else
    tats = text
  end
  for t in string.gmatch(tats, '[^,]+') do
    local v = tonumber(t) or 0
    state[#state + 1] = v
    state.latest = math.max(state.latest, v)
  end
  return state
end

-- The value that keeps TATS (µs, one per limit) as written under the stack LIMITS.
local function tats_text(tats, limits)
  local shown = {}
  for i, t in ipairs(tats) do shown[i] = string.format('%.0f', t) end
  local counts, windows = stack_sign(limits)
  shown[#shown + 1] = '#' .. counts .. '#' .. windows
  return table.concat(shown, ',')
end

-- The stack STATE was written under when it is not LIMITS, completed as LIMITS is (spans with
-- its guard setting, see with_spans); nil when it is LIMITS, when STATE does not say (read by
-- position) or when what it says cannot be read.
local function written_under(state, limits)
  if state.counts == nil then return nil end
  local counts, windows = stack_sign(limits)
  if state.counts == counts and state.windows == windows then return nil end
  local from = parse_limits((string.gsub(state.counts, ';', ',')), (string.gsub(state.windows, ';', ',')))
  if from == nil then return nil end
  return with_spans(from, limits.guard_setting or -1)
end

-- The units of the seller's reserved set (RESERVED_KEY; none when nil) whose slots lie after AT.
local function units_after(reserved_key, at)
  if reserved_key == nil then return 0 end
  local members = redis.call('ZRANGEBYSCORE', reserved_key, string.format('(%.0f', at), '+inf')
  local units = 0
  for _, member in ipairs(members) do
    local _, cost = held_parts(member)
    units = units + (cost or 1)
  end
  return units
end

-- The cells of the calls made that STATE holds ahead of NOW under the stack FROM (gcra with
-- BURST), whole: the most of any of its limits, each limit's TAT first moved back by RESERVED units
-- (the slots reserved after every call made: the end of its schedule, a grant is only made when
-- no slot lies ahead) and brought to at most BURST intervals past LAST (the latest a grant may
-- be).
local function cells_ahead(state, from, burst, now, reserved, last)
  local cells = 0
  for i, l in ipairs(from) do
    local b, interval = cell_of(l, burst)
    local tat = math.min((state[i] or state.latest) - reserved * interval, last + b * interval)
    cells = math.max(cells, math.max(tat - now, 0) / interval)
  end
  -- A cell begun is a call made: it counts whole in the new windows (a call made 1 ms ago under
  -- 20/1s, 0.98 of its cell ahead, holds a new 1/1d back a whole day, not 0.98 of one).
  return math.ceil(cells - 1e-9)
end

-- A state under the stack TO (gcra with BURST) holding CELLS of calls made ahead of NOW, then
-- RESERVED units: the calls' cells spaced at each limit's interval, never more than one span
-- (window + guard) ahead (a call made by NOW has left every window of a limit one span later,
-- so waiting longer than that would only hold callers back), the reserved units after them.
-- `ahead` is how far its latest TAT lies past NOW.
local function spaced(cells, reserved, to, burst, now)
  local state = {latest = now, ahead = 0}
  for i, l in ipairs(to) do
    local _, interval = cell_of(l, burst)
    local ahead = math.min(cells * interval, l.span) + reserved * interval
    state[i] = now + ahead
    state.latest = math.max(state.latest, state[i])
    state.ahead = math.max(state.ahead, ahead)
  end
  return state
end

-- STATE read under the stack LIMITS (gcra with BURST): as it is when it was written under LIMITS
-- (or does not say), else brought from the stack it was written under (see cells_ahead and
-- spaced). The slots still reserved in RESERVED_KEY keep their cells when they can still be
-- redeemed (reserved under a stack as strict as LIMITS or stricter, see within; a learned count
-- raised); any other is refused at its redeem (the limits changed) and reserved anew, so its
-- cell would only hold callers back. Exactness does not rest on it: every grant passes the
-- seller's calls (see include/calls.lua).
local function tats_under(state, limits, burst, now, reserved_key)
  local from = written_under(state, limits)
  if from == nil then return state end
  local early = math.floor(from.min_guard / 10)
  local reserved = units_after(reserved_key, now + early)
  local kept = 0
  if within(from, limits) then kept = reserved end
  return spaced(cells_ahead(state, from, burst, now, reserved, now + early), kept, limits, burst, now)
end

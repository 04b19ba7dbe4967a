-- @include limits
-- tats: gcra's state of a seller, one theoretical arrival time (TAT, µs, Redis time) per limit
-- of the stack that wrote it, kept with that stack ("TAT1,TAT2|COUNTS|WINDOWS_US"), and how a
-- state written under one stack is read under another (a fleet's terms raised or lowered, an
-- override, a learned count). A state written before the stack was kept ("TAT1,TAT2") is read
-- by position under whatever stack applies. Reads and writes nothing itself.
-- Defines: read_tats, tats_text, written_under, cells_ahead, spaced, tats_under

-- The state in VALUE (a GET's answer: nil or false when there is none): its TATs by position
-- (unreadable ones 0), `latest` (the latest of them, 0 when none) and, when it says, the stack's
-- `counts` and `windows`.
local function read_tats(value)
  local state = {latest = 0}
  local text = value or ''
  local tats, counts, windows = string.match(text, '^([^|]*)|([^|]+)|([^|]+)$')
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
  return table.concat(shown, ',') .. '|' .. limits.counts .. '|' .. limits.windows
end

-- The stack STATE was written under when it is not LIMITS, completed as LIMITS is (spans with
-- its guard setting, see with_spans); nil when it is LIMITS, when STATE does not say (read by
-- position) or when what it says cannot be read.
local function written_under(state, limits)
  if state.counts == nil or (state.counts == limits.counts and state.windows == limits.windows) then
    return nil
  end
  local from = parse_limits(state.counts, state.windows)
  if from == nil then return nil end
  return with_spans(from, limits.guard_setting or -1)
end

-- The cells STATE holds ahead of NOW under the stack FROM (gcra with BURST): the most of any of
-- its limits, each limit's TAT first moved back by GIVEN_BACK units (slots given back at the end
-- of its schedule) and, with LAST, brought to at most BURST intervals past LAST (the latest a
-- grant may be: a grant is only made when no slot lies ahead).
local function cells_ahead(state, from, burst, now, given_back, last)
  local cells = 0
  for i, l in ipairs(from) do
    local b = math.min(burst, l.count)
    local interval = l.span / (l.count - b + 1)
    local tat = (state[i] or state.latest) - given_back * interval
    if last then tat = math.min(tat, last + b * interval) end
    cells = math.max(cells, math.max(tat - now, 0) / interval)
  end
  return cells
end

-- A state under the stack TO (gcra with BURST) holding CELLS ahead of NOW: spaced at each limit's
-- interval, never more than one span ahead (a call made by NOW has left every window of a limit
-- one span later, so waiting longer than that would only hold callers back). `ahead` is how far
-- its latest TAT lies past NOW.
local function spaced(cells, to, burst, now)
  local state = {latest = now, ahead = 0}
  for i, l in ipairs(to) do
    local b = math.min(burst, l.count)
    local ahead = math.min(cells * l.span / (l.count - b + 1), l.span)
    state[i] = now + ahead
    state.latest = math.max(state.latest, state[i])
    state.ahead = math.max(state.ahead, ahead)
  end
  return state
end

-- STATE read under the stack LIMITS (gcra with BURST): as it is when it was written under LIMITS
-- (or does not say), else brought from the stack it was written under (see spaced). Exactness
-- does not rest on it: every grant passes the calls gate (see include/calls.lua).
local function tats_under(state, limits, burst, now)
  local from = written_under(state, limits)
  if from == nil then return state end
  return spaced(cells_ahead(state, from, burst, now, 0), limits, burst, now)
end

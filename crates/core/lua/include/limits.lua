-- @include args
-- limits: a stack of limits (COUNTS and WINDOWS) as the scripts take and compare it, and what
-- every script derives from it (guards, spans). Reads and writes nothing.
-- Defines: csv, MAX_STACK, parse_limits_once, parsed_stacks, parse_limits, limits_arg, guard_for,
--   with_spans, within

-- NUMBERS as the scripts write them: whole numbers, comma-separated (a stack's COUNTS or
-- WINDOWS, learned counts).
local function csv(numbers)
  local shown = {}
  for i, n in ipairs(numbers) do shown[i] = string.format('%.0f', n) end
  return table.concat(shown, ',')
end

-- Most limits in a stack (see parse_limits; config::Limits::MAX in Rust, checked equal).
local MAX_STACK = 8

-- A stack of limits, all of which must hold, from COUNTS ("C1,C2,...") and WINDOWS
-- ("W1,W2,..." in µs): as many of each, 1 to MAX_STACK, integers >= 1 without leading zeros,
-- windows strictly increasing (as `Limits` in config.rs writes them). A window written
-- `W@PHASE` is a calendar limit (sliding-window only, see include/calendar.lua): at most COUNT
-- in each window of W µs starting PHASE µs (0 <= PHASE < W) after a multiple of W since the
-- epoch, e.g. a day starting at 15:00 UTC. Returns a list of {count, window, phase (calendar
-- only)}, with `counts` and `windows` the terms as given (how they are answered and compared),
-- or nil when malformed.
local function parse_limits_once(counts, windows)
  local limits = {counts = counts, windows = windows}
  for c in string.gmatch(counts, '[^,]+') do
    if not string.match(c, '^%d+$') or tonumber(c) < 1 or #limits >= MAX_STACK then return nil end
    limits[#limits + 1] = {count = tonumber(c)}
  end
  local i = 0
  for w in string.gmatch(windows, '[^,]+') do
    i = i + 1
    local window, phase = string.match(w, '^(%d+)@(%d+)$')
    if window == nil then window = string.match(w, '^(%d+)$') end
    if window == nil or tonumber(window) < 1 or limits[i] == nil then return nil end
    limits[i].window = tonumber(window)
    if phase ~= nil then
      limits[i].phase = tonumber(phase)
      if limits[i].phase >= limits[i].window then return nil end
    end
  end
  if i == 0 or i ~= #limits then return nil end
  -- Only the form turnstile writes: plain integers, windows strictly increasing (a stack sorted
  -- by window, no two alike), so that a stack compares equal to itself as text.
  local listed_counts, listed_windows = {}, {}
  for j, l in ipairs(limits) do
    if j > 1 and l.window <= limits[j - 1].window then return nil end
    listed_counts[j] = l.count
    listed_windows[j] = string.format('%.0f', l.window)
    if l.phase ~= nil then listed_windows[j] = listed_windows[j] .. '@' .. string.format('%.0f', l.phase) end
  end
  if csv(listed_counts) ~= counts or table.concat(listed_windows, ',') ~= windows then return nil end
  return limits
end

-- The stacks this call has parsed, by their text (false: malformed). The operations of a batch
-- mostly pass the same default stack, and parsing it is a good part of an operation's cost.
local parsed_stacks = {}

-- parse_limits_once, each stack parsed once per call: every caller gets a table of its own (it
-- may complete it, see with_spans, or change its counts, see with_learned).
local function parse_limits(counts, windows)
  if type(counts) ~= 'string' or type(windows) ~= 'string' then return nil end
  local text = counts .. ' ' .. windows
  local parsed = parsed_stacks[text]
  if parsed == nil then
    parsed = parse_limits_once(counts, windows) or false
    parsed_stacks[text] = parsed
  end
  if not parsed then return nil end
  local limits = {counts = counts, windows = windows}
  for i, l in ipairs(parsed) do limits[i] = {count = l.count, window = l.window, phase = l.phase} end
  return limits
end

-- The default stack in ARGV[i] (COUNTS) and ARGV[i + 1] (WINDOWS), or the script fails before
-- anything is written.
local function limits_arg(i)
  local limits = parse_limits(ARGV[i], ARGV[i + 1])
  if limits == nil then
    error({err = 'ERR turnstile: ARGV[' .. i .. '] and ARGV[' .. (i + 1) ..
      '] must be COUNTS and WINDOWS: 1 to ' .. MAX_STACK .. ' integers >= 1 each, comma-separated'})
  end
  return limits
end

-- Guard added to a window (µs): as configured, or window/20 within [25 ms, 2 s] when < 0
-- (config::guard_for in Rust; src/permit/scripts.rs checks that they agree).
local function guard_for(window, guard)
  if guard >= 0 then return guard end
  return math.min(math.max(math.floor(window / 20), 25000), 2000000)
end

-- Completes a stack with what every script derives from it: each limit's guard (GUARD as in
-- guard_for) and span (window + guard), and over the stack: min_count, max_count, min_guard,
-- min_span, max_span and max_window, `slowest`, the limit with the lowest long-run rate
-- (count/span), `has_calendar` when a limit is a calendar limit, and `guard_setting` (GUARD:
-- another stack completed the same way, see written_under in include/tats.lua).
local function with_spans(limits, guard)
  limits.guard_setting = guard
  for _, l in ipairs(limits) do
    l.guard = guard_for(l.window, guard)
    l.span = l.window + l.guard
    if limits.min_count == nil or l.count < limits.min_count then limits.min_count = l.count end
    if limits.min_guard == nil or l.guard < limits.min_guard then limits.min_guard = l.guard end
    if limits.min_span == nil or l.span < limits.min_span then limits.min_span = l.span end
    if limits.max_span == nil or l.span > limits.max_span then limits.max_span = l.span end
    if limits.max_window == nil or l.window > limits.max_window then limits.max_window = l.window end
    if limits.max_count == nil or l.count > limits.max_count then limits.max_count = l.count end
    if limits.slowest == nil or l.count * limits.slowest.span < limits.slowest.count * l.span then
      limits.slowest = l
    end
    if l.phase ~= nil then limits.has_calendar = true end
  end
  return limits
end

-- Whether the stack HELD is as strict as LIMITS or stricter: the same windows, and no count
-- above LIMITS' (a slot reserved under HELD is good under LIMITS: every window it was reserved
-- to keep within HELD's count is within LIMITS' too).
local function within(held, limits)
  if held.windows ~= limits.windows or #held ~= #limits then return false end
  for i, l in ipairs(held) do
    if l.count > limits[i].count then return false end
  end
  return true
end

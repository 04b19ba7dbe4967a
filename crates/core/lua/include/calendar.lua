-- @include limits
-- calendar: a calendar limit of a sliding-window stack (`W@PHASE`, see parse_limits_once): at
-- most COUNT units in each window of W µs that starts PHASE µs after a multiple of W since the
-- epoch (a provider's day, starting at its reset's time of day). Its units are the slots of the
-- seller's log (or a route's), as for the sliding limits of the stack.
-- A call is counted by the API when it arrives, between its grant and its answer: one granted
-- less than ZONE before a reset (its BOUND, the limit's GUARD and the earliest a grant may come
-- before its slot) may arrive after it. Such a unit counts in both windows; a slot is placed no
-- earlier than GUARD + EARLY after a reset; and a reservation redeemed so late that its call
-- could reach another window than its slot's is forfeited (calendar_late). So no window, as the
-- API counts it, holds more than COUNT.
-- Defines: calendar_start, calendar_units, calendar_fit, calendar_late

-- The start of L's calendar window holding T (µs).
local function calendar_start(l, t)
  return t - ((t - l.phase) % l.window)
end

-- The units of LOG_KEY counted in L's window starting at START: those slotted in it, and those
-- slotted less than ZONE before it.
local function calendar_units(log_key, l, start, zone)
  return redis.call('ZCOUNT', log_key, string.format('%.0f', start - zone),
    string.format('(%.0f', start + l.window))
end

-- The earliest slot from SLOT at which L's windows have room for COST more units of LOG_KEY:
-- the window of the slot (and the next one too when the slot lies within ZONE of its end), or
-- else the start of a later window, GUARD + EARLY after it (AFTER). Looks at most 64 windows
-- ahead. Any slot found is also checked by the other limits of the stack (see fit).
local function calendar_fit(log_key, l, slot, cost, zone, after)
  for _ = 1, 64 do
    local start = calendar_start(l, slot)
    local fits = calendar_units(log_key, l, start, zone) + cost <= l.count
    if fits and slot >= start + l.window - zone then
      fits = calendar_units(log_key, l, start + l.window, zone) + cost <= l.count
    end
    if fits then return slot end
    slot = start + l.window + after
  end
  return slot
end

-- Whether a call granted NOW for a unit slotted at SLOT could reach the API in another of L's
-- windows than the one (or two, within ZONE of its end) its slot is counted in.
local function calendar_late(l, slot, now, zone)
  local start = calendar_start(l, slot)
  local ends = start + l.window
  if slot >= ends - zone then return now + zone >= ends + l.window end
  return now + zone >= ends
end

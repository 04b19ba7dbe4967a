-- @include calendar
-- @include limits
-- fit: where COST more units fit a stack of limits (sliding windows and calendar limits) in a log
-- of units (sorted set: the units of each TOKEN, score = slot): the seller's sliding-window log,
-- a route's log.
-- Defines: stack_fit, GAPS, fits_at, gap_fit

-- The earliest slot from SLOT at which LOG_KEY leaves room for COST more units under every limit
-- of STACK, one pass: a sliding limit's after the log's last slot and SPAN after the most recent
-- unit that must leave for COST more to fit (then no window of SPAN holding the new slot holds
-- more than COUNT; any later slot fits too); a calendar limit's as calendar_fit, with ZONE and
-- AFTER plus its guard. Notes each limit's units from now on (l.logged) and returns the slot,
-- how much of the most taken limit the units leave taken, in thousandths, and whether the slot
-- is later than the counts alone need by more than the stack's shortest span (only the log's
-- last: the log may have room before its end, e.g. a slot reserved far ahead under a slower
-- window before the terms were raised; see gap_fit). A slot pushed back less than that is not
-- looked into: it waits at most one span more than it might, while looking (up to GAPS tries,
-- each reading two spans of the log) would cost a backlog's every reservation far more Redis
-- time than the wait is worth.
local function stack_fit(log_key, stack, slot, now, cost, zone, after)
  local used, last, counted = 0, nil, slot
  for _, l in ipairs(stack) do
    local n
    if l.phase ~= nil then
      slot = calendar_fit(log_key, l, slot, cost, zone + l.guard, after + l.guard)
      n = calendar_units(log_key, l, calendar_start(l, math.max(slot, now)), zone + l.guard)
      counted = math.max(counted, slot)
    else
      -- Units counted by this limit from now on: those slotted within its span back from now.
      n = redis.call('ZCOUNT', log_key, string.format('(%.0f', now - l.span), '+inf')
      local room = l.count - cost
      if n > room then
        last = last or tonumber(redis.call('ZRANGE', log_key, -1, -1, 'WITHSCORES')[2])
        local kth = tonumber(redis.call('ZREVRANGE', log_key, room, room, 'WITHSCORES')[2])
        counted = math.max(counted, kth + l.span)
        slot = math.max(slot, last, kth + l.span)
      end
    end
    used = math.max(used, math.floor(math.min(n + cost, l.count) * 1000 / l.count))
    l.logged = n
  end
  return slot, used, slot > counted + stack.min_span
end

-- Most moments gap_fit tries before the end of a log.
local GAPS = 64

-- Whether one more unit of COST at T leaves every window of every sliding limit of STACK that
-- holds T within its COUNT, among the units of LOG_KEY (windows of SPAN, half-open, as the
-- append rule counts them: a unit SPAN before T is out).
local function fits_at(log_key, stack, t, cost)
  for _, l in ipairs(stack) do
    if l.phase == nil then
      local found = redis.call('ZRANGEBYSCORE', log_key, string.format('(%.0f', t - l.span),
        string.format('(%.0f', t + l.span), 'WITHSCORES')
      local scores = {}
      for i = 2, #found, 2 do scores[#scores + 1] = tonumber(found[i]) end
      -- The windows holding T start in (T - SPAN, T]: the fullest starts just after T - SPAN
      -- or at one of those units.
      local starts = {t - l.span + 1}
      for _, u in ipairs(scores) do
        if u <= t then starts[#starts + 1] = u end
      end
      local lo, hi, n = 1, 1, #scores
      for _, x in ipairs(starts) do
        while lo <= n and scores[lo] < x do lo = lo + 1 end
        if hi < lo then hi = lo end
        while hi <= n and scores[hi] < x + l.span do hi = hi + 1 end
        if hi - lo + cost > l.count then return false end
      end
    end
  end
  return true
end

-- The earliest moment from FROM, before UPTO (a slot after the log's last, which always fits),
-- at which a unit of COST fits every sliding window of STACK in LOG_KEY (fits_at): FROM, or a
-- moment a unit leaves a window; UPTO when none of the first GAPS does. A call on a route
-- slotted after every reservation of the seller's log would leave room unused where its own
-- route is free and the faster routes' reservations left the budget room: it takes that room.
local function gap_fit(log_key, stack, from, upto, cost)
  if upto <= from then return upto end
  local moments = {from}
  for _, l in ipairs(stack) do
    if l.phase == nil then
      local leaving = redis.call('ZRANGEBYSCORE', log_key, string.format('(%.0f', from - l.span),
        string.format('(%.0f', upto - l.span), 'WITHSCORES', 'LIMIT', 0, GAPS)
      for i = 2, #leaving, 2 do moments[#moments + 1] = tonumber(leaving[i]) + l.span end
    end
  end
  table.sort(moments)
  local tried, previous = 0, nil
  for _, t in ipairs(moments) do
    if t >= upto or tried >= GAPS then break end
    if t ~= previous then
      tried = tried + 1
      if fits_at(log_key, stack, t, cost) then return t end
    end
    previous = t
  end
  return upto
end

-- @include reservations
-- far: the seller's far queue (hash: `at`, `n`, `span`), for callers a full reserved set turns away:
-- told when to come back, in order, holding nothing.
-- Defines: far_ticket, slot_or_far_ticket

-- When a caller turned away by a full reserved set should come back (Redis µs): its place in
-- the seller's far queue (FAR_KEY, hash: `at` = when the next callers come back, `n` = how many
-- were told `at`). The far queue lets COUNT callers come back per SPAN, from one emission
-- interval (SPAN/COUNT) after the first reserved slot is due: the pace at which reserved slots
-- are redeemed and free room, so each comes back about when there is room to reserve, and a
-- backlog however deep is told when to come back in order, never all at once. Three numbers:
-- the third, `span`, is the SPAN the queue was told under: under another one (the fleet's terms
-- changed: a far stricter replica gone, a raise) it starts afresh, so that tickets told under
-- terms no longer in force never push new ones back (their holders ask anew, see the worker).
local function far_ticket(far_key, reserved_key, now, span, count)
  local f = redis.call('HMGET', far_key, 'at', 'n', 'span')
  local at, n = tonumber(f[1]) or 0, tonumber(f[2]) or 0
  local told_under = string.format('%.0f', span)
  if f[3] ~= told_under then at, n = 0, 0 end
  local first = tonumber(redis.call('ZRANGE', reserved_key, 0, 0, 'WITHSCORES')[2] or '') or now
  local start = math.max(now, first) + span / count
  if at < start - span then
    at, n = start, 0 -- the far queue came back long ago: start afresh
  elseif at < start then
    at = start
  end
  local ticket = at
  n = n + 1
  if n >= count then at, n = at + span, 0 end
  redis.call('HSET', far_key, 'at', string.format('%.0f', at), 'n', n, 'span', told_under)
  redis.call('PEXPIRE', far_key, math.floor((at - now + span) / 1000) + 1)
  return ticket
end

-- The reserving step of every acquire script. A wait (STATUS 2) takes a slot in the seller's
-- reserved set RESERVED_KEY, unless the set is full, or CROWDED (optional: the seller's state
-- holds as many units as reservations may add, see log_crowded): then it gets a ticket of the
-- far queue FAR_KEY instead (status 0: come back at the ticket's time, holding nothing; see
-- far_ticket), paced by the stack's slowest limit at the caller's cost. Returns STATUS, SLOT.
local function slot_or_far_ticket(status, slot, reserved_key, far_key, now, late, limits, a, crowded)
  if status == 2 and (reserved_full(reserved_key, now, late, a.state, a.algorithm, limits) or crowded) then
    local per_span = math.max(math.floor(limits.slowest.count / a.cost), 1)
    return 0, far_ticket(far_key, reserved_key, now, limits.slowest.span, per_span)
  end
  return status, slot
end

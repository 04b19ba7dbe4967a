-- @include limits
-- @include units
-- learned: adaptive limits, as learn.lua and complete.lua keep them: the seller's learned state
-- (hash LEARNED_KEY, see learn.lua) and its accepted log (sorted set ACCEPTED_KEY), what a 429
-- lowers a count to and how later evidence corrects it, and when a learned count is due to
-- change. (How the learned counts apply: with_learned, in terms.)
-- Defines: learned_ttl, learned_state, accepted_in, lowered_count, corrected_count, evidence_of,
--   corrections, raise_due, note_accepted

-- Adaptive limits: how long a seller's learned state outlives the last answer it was kept alive
-- by (ms): 10 minutes, or 10 of the configured stack's longest windows if longer.
local function learned_ttl(configured)
  return math.max(600000, math.floor(configured.max_window / 100))
end

-- The seller's learned state (LEARNED_KEY, see learn.lua) for the stack CONFIGURED: `counts`
-- (one per limit; the configured count where nothing is learned, never above it), `from` (the
-- counts before the last change), `at` (when that was, µs; 0 if never), `why`, and `patience`
-- (how many of a limit's windows of full use a raise waits for). A state learned under other
-- terms reads as nothing learned (`fresh`).
local function learned_state(learned_key, configured)
  local s = redis.call('HMGET', learned_key, 'terms', 'counts', 'from', 'at', 'why', 'patience')
  local st = {counts = {}, from = {}, at = 0, why = '', patience = 1, fresh = true}
  for i, l in ipairs(configured) do
    st.counts[i] = l.count
    st.from[i] = l.count
  end
  if s[1] ~= configured.counts .. ' ' .. configured.windows then return st end
  st.fresh = false
  for name, text in pairs({counts = s[2], from = s[3]}) do
    local read = parse_limits(text, configured.windows)
    if read then
      for i, l in ipairs(read) do st[name][i] = math.min(l.count, configured[i].count) end
    end
  end
  st.at = tonumber(s[4]) or 0
  st.why = s[5] or ''
  st.patience = math.max(tonumber(s[6]) or 1, 1)
  return st
end

-- Units the downstream accepted within the last LENGTH µs up to NOW (ACCEPTED_KEY, see
-- note_accepted).
local function accepted_in(accepted_key, length, now)
  return redis.call('ZCOUNT', accepted_key, string.format('(%.0f', now - length), '+inf')
end

-- What a 429 lowers a learned COUNT to, when the downstream ACCEPTED that many units in the
-- limit's window up to the 429: what it accepted (multiplicative decrease); half of COUNT when it
-- accepted COUNT or more (it counts differently) or nothing (no evidence); never below FLOOR.
local function lowered_count(count, accepted, floor)
  local n = accepted
  if n >= count or n == 0 then n = math.floor(count / 2) end
  return math.max(floor, n)
end

-- What a learned COUNT that a 429 lowered from FROM is corrected to now that the downstream is
-- seen to have ACCEPTED more in the window of that 429 (answers of one burst come back in any
-- order, and a 2xx is recorded only after its result is published): what it accepted, below
-- FROM (which it refused). Only ever up: what was accepted so far is a lower bound of the real
-- limit. Returns nil when it stays.
local function corrected_count(count, from, accepted)
  local n = math.min(accepted, from - 1)
  if n > count then return n end
  return nil
end

-- The units the downstream accepted (ACCEPTED_KEY) in the window of the limit L that ends at the
-- last 429 that lowered it (AT, in the state): answers that came back within L's window before
-- it, or within L's guard after it (an answer of the same burst can come back after the 429's
-- lesson; the lowered limit grants nothing that soon after a full window), whenever recorded.
local function evidence_of(accepted_key, l, at)
  return redis.call('ZCOUNT', accepted_key, string.format('(%.0f', at - l.window),
    string.format('%.0f', at + l.guard))
end

-- The counts the last 429 lowered (the state ST, for the stack CONFIGURED) that are due to be
-- corrected (see corrected_count), by limit index: what each goes up to, the downstream having
-- since been seen to accept more in that window. Empty unless the last change was a 429.
local function corrections(st, configured, accepted_key)
  local due = {}
  if st.why ~= '429' then return due end
  for i, l in ipairs(configured) do
    if st.counts[i] < st.from[i] then
      due[i] = corrected_count(st.counts[i], st.from[i], evidence_of(accepted_key, l, st.at))
    end
  end
  return due
end

-- The limits of CONFIGURED whose learned count (in the state ST) is due to go up: it is below the
-- configured count, the downstream accepted in the limit's last window at least what the learned
-- count lets through one window at full use, however paced (COUNT per WINDOW + guard: at most
-- ceil(COUNT * WINDOW / span) in a window; the learned limit was used in full without a 429),
-- and `patience` of its windows passed since the last change. Returns their indexes (an empty
-- list: none).
local function raise_due(st, configured, accepted_key, now)
  local due = {}
  for i, l in ipairs(configured) do
    if st.counts[i] < l.count and now - st.at >= st.patience * l.window
        and accepted_in(accepted_key, l.window, now) >= math.ceil(st.counts[i] * l.window / l.span) then
      due[#due + 1] = i
    end
  end
  return due
end

-- Adaptive limits: records in the seller's accepted log (ACCEPTED_KEY: sorted set of the units
-- the downstream accepted, score = when the answer came back; within the configured stack's
-- longest window + guard, and at most twice its largest COUNT + COST of them) that the call TOKEN of COST
-- units was accepted NOW, keeps the learned state (LEARNED_KEY) alive while the seller is
-- answered, and returns 1 when a learned count is due to change (raise_due, corrections),
-- else 0.
local function note_accepted(learned_key, accepted_key, configured, token, cost, now)
  redis.call('ZREMRANGEBYSCORE', accepted_key, '-inf', now - configured.max_span)
  add_units(accepted_key, now, token, cost)
  redis.call('ZREMRANGEBYRANK', accepted_key, 0, -(2 * configured.max_count + cost + 1))
  redis.call('PEXPIRE', accepted_key, math.floor(configured.max_span / 1000) + 1)
  if redis.call('EXISTS', learned_key) == 0 then return 0 end
  if redis.call('PTTL', learned_key) < learned_ttl(configured) then
    redis.call('PEXPIRE', learned_key, learned_ttl(configured))
  end
  local st = learned_state(learned_key, configured)
  if next(corrections(st, configured, accepted_key)) ~= nil
      or #raise_due(st, configured, accepted_key, now) > 0 then
    return 1
  end
  return 0
end

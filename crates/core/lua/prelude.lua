-- prelude: prepended to every turnstile script (see src/permit/scripts.rs). Defines helpers
-- only; reads and writes nothing by itself.

-- The call's keys and arguments, as locals every helper and script below reads: batch.lua runs
-- several operations in one call by giving each its own before it runs.
local KEYS, ARGV = KEYS, ARGV

-- ARGV[i] as an integer >= min, or the script fails before anything is written.
local function int_arg(i, min)
  local v = tonumber(ARGV[i])
  if v == nil or v ~= math.floor(v) or v < min then
    error({err = 'ERR turnstile: ARGV[' .. i .. '] must be an integer >= ' .. min})
  end
  return v
end

-- ARGV[i] as a reservation TOKEN (1 to 64 letters, digits or dashes), or the script fails
-- before anything is written.
local function token_arg(i)
  local token = ARGV[i]
  if token == nil or not string.match(token, '^[%w-]+$') or #token > 64 then
    error({err = 'ERR turnstile: TOKEN must be 1 to 64 letters, digits or dashes'})
  end
  return token
end

-- ARGV[i] as when a call's answer came back (ANSWERED_US, Redis time in µs, at most NOW): the
-- caller's upper bound for it (the grant's Redis time plus the time it measured from asking
-- for the permit to the answer), so that a record written later still ends the call when its
-- answer came; -1 or absent: NOW.
local function answered_arg(i, now)
  if ARGV[i] == nil or ARGV[i] == '-1' then return now end
  return math.min(int_arg(i, 0), now)
end

-- NUMBERS as the scripts write them: whole numbers, comma-separated (a stack's COUNTS or
-- WINDOWS, learned counts).
local function csv(numbers)
  local shown = {}
  for i, n in ipairs(numbers) do shown[i] = string.format('%.0f', n) end
  return table.concat(shown, ',')
end

-- Most limits in a stack (see parse_limits).
local MAX_STACK = 8

-- A stack of limits, all of which must hold, from COUNTS ("C1,C2,...") and WINDOWS
-- ("W1,W2,..." in µs): as many of each, 1 to MAX_STACK, integers >= 1 without leading zeros,
-- windows strictly increasing (as `Limits` in config.rs writes them). Returns a list of
-- {count, window}, with `counts` and `windows` the terms as given (how they are answered and
-- compared), or nil when malformed.
local function parse_limits_once(counts, windows)
  local limits = {counts = counts, windows = windows}
  for c in string.gmatch(counts, '[^,]+') do
    if not string.match(c, '^%d+$') or tonumber(c) < 1 or #limits >= MAX_STACK then return nil end
    limits[#limits + 1] = {count = tonumber(c)}
  end
  local i = 0
  for w in string.gmatch(windows, '[^,]+') do
    i = i + 1
    if not string.match(w, '^%d+$') or tonumber(w) < 1 or limits[i] == nil then return nil end
    limits[i].window = tonumber(w)
  end
  if i == 0 or i ~= #limits then return nil end
  -- Only the form turnstile writes: plain integers, windows strictly increasing (a stack sorted
  -- by window, no two alike), so that a stack compares equal to itself as text.
  local listed_counts, listed_windows = {}, {}
  for j, l in ipairs(limits) do
    if j > 1 and l.window <= limits[j - 1].window then return nil end
    listed_counts[j], listed_windows[j] = l.count, l.window
  end
  if csv(listed_counts) ~= counts or csv(listed_windows) ~= windows then return nil end
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
  for i, l in ipairs(parsed) do limits[i] = {count = l.count, window = l.window} end
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

-- Adaptive limits: the seller's learned state (hash LEARNED_KEY, written by learn.lua; see there)
-- lowers the counts of the stack it was learned under (`terms`, "COUNTS WINDOWS_US"). The stack
-- that applies is CONFIGURED with each count min(configured, learned), but never below COST where
-- the configured count allows COST (a call the configured stack can grant is never refused for a
-- learned count). A learned state for other terms (the limit changed since) is ignored. The
-- downstream's quota (`left` units until `until` µs, from rate-limit headers) is read with it, as
-- `quota_left` and `quota_until`; `configured` is CONFIGURED. Returns CONFIGURED when nothing is
-- learned.
local function with_learned(learned_key, configured, cost)
  local s = redis.call('HMGET', learned_key, 'terms', 'counts', 'left', 'until')
  if s[1] ~= configured.counts .. ' ' .. configured.windows then return configured end
  local learned = parse_limits(s[2], configured.windows)
  if learned == nil or #learned ~= #configured then return configured end
  local counts = {}
  for i, l in ipairs(learned) do
    local c = configured[i].count
    l.count = math.min(c, math.max(l.count, math.min(cost, c)))
    counts[i] = l.count
  end
  learned.counts = csv(counts)
  learned.configured = configured
  learned.quota_left = tonumber(s[3])
  learned.quota_until = tonumber(s[4])
  return learned
end

-- The stack that applies: the seller's override ("COUNTS WINDOWS_US", e.g. "6,20 1000000,5000000";
-- one limit is "COUNT WINDOW_US" as earlier versions wrote it) if set and well-formed, else DEFAULT;
-- with LEARNED_KEY (adaptive limits on), its learned counts for a call of COST (see with_learned).
local function effective_limits(override_key, default, learned_key, cost)
  local configured = default
  local override = redis.call('GET', override_key)
  if override then
    local limits = parse_limits(string.match(override, '^([%d,]+) ([%d,]+)$'))
    if limits then configured = limits end
  end
  if learned_key == nil then return configured end
  return with_learned(learned_key, configured, cost or 1)
end

-- Guard added to a window (µs): as configured, or window/20 within [25 ms, 2 s] when < 0.
local function guard_for(window, guard)
  if guard >= 0 then return guard end
  return math.min(math.max(math.floor(window / 20), 25000), 2000000)
end

-- Completes a stack with what every script derives from it: each limit's guard (GUARD as in
-- guard_for) and span (window + guard), and over the stack: min_count, max_count, min_guard,
-- min_span, max_span and max_window, and `slowest`, the limit with the lowest long-run rate (count/span).
local function with_spans(limits, guard)
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
  end
  return limits
end

-- The members of a sorted set that stand for the COST units of a call or slot TOKEN: TOKEN
-- itself, then TOKEN*2 up to TOKEN*COST (a token is letters, digits and dashes only).
local function unit(token, i)
  if i == 1 then return token end
  return token .. '*' .. i
end

-- Runs COMMAND on the sorted set KEY with the COST units of TOKEN (each after SCORE, if given),
-- in variadic calls of at most 500 units: ZADD adds them, ZREM removes them.
local function for_units(command, key, token, cost, score)
  local args = {}
  for i = 1, cost do
    if score ~= nil then args[#args + 1] = score end
    args[#args + 1] = unit(token, i)
    if #args >= 1000 then
      redis.call(command, key, unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call(command, key, unpack(args)) end
end

-- Adds the COST units of TOKEN to the sorted set KEY at SCORE.
local function add_units(key, score, token, cost)
  for_units('ZADD', key, token, cost, score)
end

-- Removes the COST units of TOKEN from the sorted set KEY.
local function remove_units(key, token, cost)
  for_units('ZREM', key, token, cost)
end

-- How a reservation of COST units is named in the seller's reserved set: TOKEN for one unit
-- (as earlier versions named every reservation), TOKEN+COST otherwise. Redeeming needs both, so
-- a reservation is bound to its entry and to its weight.
local function held_name(token, cost)
  if cost == 1 then return token end
  return token .. '+' .. cost
end

-- The TOKEN and COST of a reserved set's member (see held_name).
local function held_parts(member)
  local token, cost = string.match(member, '^([%w-]+)%+(%d+)$')
  if token then return token, tonumber(cost) end
  return member, 1
end

-- Redis server time in µs: the only clock a limit is measured on.
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The seller's pause end in µs (0 when not paused).
local function paused_until(pause_key)
  return tonumber(redis.call('GET', pause_key) or '0')
end

-- Pauses the seller (PAUSE_KEY) until UNTIL_US, unless it is paused longer already: a pause only
-- extends. Returns the pause's end.
local function extend_pause(pause_key, until_us, now)
  local current = paused_until(pause_key)
  if current >= until_us then return current end
  redis.call('SET', pause_key, string.format('%.0f', until_us), 'PX', math.floor((until_us - now) / 1000) + 1)
  return until_us
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

-- The earliest a call of COST units may be slotted: after the seller's pause (PAUSE_KEY) and,
-- when the downstream's quota (see with_learned) has fewer than COST units left, after its reset.
local function not_before(pause_key, limits, cost, now)
  local at = paused_until(pause_key)
  local u = limits.quota_until
  if u ~= nil and u > now and (limits.quota_left or 0) < cost then at = math.max(at, u) end
  return at
end

-- A call (or reservation) of COST units slotted at SLOT before the quota's reset takes its units
-- from the quota's `left` (see not_before).
local function take_quota(learned_key, limits, slot, cost, now)
  local u = limits.quota_until
  if learned_key == nil or u == nil or u <= now or slot >= u then return end
  redis.call('HINCRBY', learned_key, 'left', -cost)
end

-- Most units one call may take (COST): a larger cost is refused before anything is written.
local MAX_COST = 10000

-- The common arguments of the acquire scripts (see each script's header).
local function acquire_args(algorithm)
  local a = {
    algorithm = algorithm, state = KEYS[1],
    limits = limits_arg(1), guard = int_arg(3, -1),
    flags = int_arg(4, 0), horizon = int_arg(5, 0),
  }
  if a.flags > 7 then error({err = 'ERR turnstile: FLAGS must be 0 to 7'}) end
  a.token = token_arg(6)
  a.bound = int_arg(7, 0)
  a.cost = int_arg(8, 1)
  if a.cost > MAX_COST then error({err = 'ERR turnstile: COST must be at most ' .. MAX_COST}) end
  a.reserve = a.flags % 2
  a.durable = math.floor(a.flags / 2) % 2 == 1
  -- The keys every acquire script takes after its own seven (see sliding_window.lua).
  if a.flags >= 4 then a.learned = KEYS[8] end
  a.shadow, a.shadow_log, a.losses, a.done = KEYS[9], KEYS[10], KEYS[11], KEYS[12]
  return a
end

-- The answer of the acquire scripts to a call whose cost the seller's limits can never grant
-- (more than MAX units at once): status 4, nothing written.
local function never(max, now, limits)
  return {4, max, now, limits.counts, limits.windows}
end

-- The answer of the acquire scripts, shared so that they decide alike:
-- granted if the slot is due within EARLY (guard/10), else reserved, or denied when reserving
-- is off or the slot lies beyond the horizon.
local function due(slot, now, guard, a)
  local wait = slot - now
  if wait <= math.floor(guard / 10) then return 1 end
  if a.reserve == 0 or wait > a.horizon then return 0 end
  return 2
end

-- Most slots a seller holds reserved at once: beyond them, a waiting caller is told when to come
-- back without a slot (far_ticket), so a seller's state stays bounded however deep its backlog.
local MAX_RESERVED = 3072

-- How late past its slot a reservation may still be redeemed (µs). The exact algorithms check
-- every grant against the calls of the last window (calls_gate), so a late call cannot break
-- their limit: a message late for its slot (it waited for a worker, the broker was slow) is
-- still served up to one window + guard late (the shortest of the stack). The others count the
-- call at its slot only: GUARD/2 (the smallest of the stack).
local function lateness(algorithm, limits)
  if algorithm == 'sliding-window' or algorithm == 'gcra' then return limits.min_span end
  return math.floor(limits.min_guard / 2)
end


-- When a caller turned away by a full reserved set should come back (Redis µs): its place in
-- the seller's far queue (FAR_KEY, hash: `at` = when the next callers come back, `n` = how many
-- were told `at`). The far queue lets COUNT callers come back per SPAN, from one emission
-- interval (SPAN/COUNT) after the first reserved slot is due: the pace at which reserved slots
-- are redeemed and free room, so each comes back about when there is room to reserve, and a
-- backlog however deep is told when to come back in order, never all at once. Two numbers.
local function far_ticket(far_key, reserved_key, now, span, count)
  local f = redis.call('HMGET', far_key, 'at', 'n')
  local at, n = tonumber(f[1]) or 0, tonumber(f[2]) or 0
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
  redis.call('HSET', far_key, 'at', string.format('%.0f', at), 'n', n)
  redis.call('PEXPIRE', far_key, math.floor((at - now + span) / 1000) + 1)
  return ticket
end

-- Whether the message already registered: its completion record (KEYS[n] if passed) says
-- `registered` (or `1`, as earlier versions wrote it). A dead letter's record (`dead:<REASON>`)
-- is not done: a replayed or duplicate copy is called again (see complete.lua).
local function already_done(key)
  if key == nil then return false end
  local state = redis.call('GET', key)
  return state == 'registered' or state == '1'
end

-- ARGV[i], ARGV[i+1], ARGV[i+2] as a batch: SELLER (the seller's id, 1 to 512 bytes), BATCH
-- (the batch's id, 1 to 1024 bytes) and SIZE (the message's batch_size, 0 to 1000000; 0 =
-- none), or the script fails before anything is written.
local function batch_args(i)
  local seller, id = ARGV[i], ARGV[i + 1]
  if seller == nil or #seller < 1 or #seller > 512 then
    error({err = 'ERR turnstile: SELLER must be 1 to 512 bytes'})
  end
  if id == nil or #id < 1 or #id > 1024 then
    error({err = 'ERR turnstile: BATCH must be 1 to 1024 bytes'})
  end
  local size = int_arg(i + 2, 0)
  if size > 1000000 then error({err = 'ERR turnstile: BATCH_SIZE must be at most 1000000'}) end
  return {seller = seller, id = id, size = size}
end

-- Writes what a batch's progress (hash KEY) says of itself, once: its seller and id, when it was
-- first seen (`first_ms`), and its total (the first SIZE given); a later message giving another
-- size is noted in `other_size` (the total stays).
local function describe_batch(key, batch)
  redis.call('HSETNX', key, 'seller', batch.seller)
  redis.call('HSETNX', key, 'batch', batch.id)
  redis.call('HSETNX', key, 'first_ms', math.floor(now_us() / 1000))
  if batch.size > 0 and redis.call('HSETNX', key, 'total', batch.size) == 0
    and tonumber(redis.call('HGET', key, 'total')) ~= batch.size then
    redis.call('HSET', key, 'other_size', batch.size)
  end
end

-- The pending completion event of the batch whose progress is KEY (its `completed_ms`), or ''.
-- A batch with a total whose registered + dead reach it completes now (`completed_ms` and
-- `event` set, once); one taken below it again (a replay) is open again (both removed).
local function batch_event(key)
  if key == nil then return '' end
  local f = redis.call('HMGET', key, 'total', 'registered', 'dead', 'completed_ms', 'event')
  local total = tonumber(f[1])
  if total == nil then return '' end
  local done = (tonumber(f[2]) or 0) + (tonumber(f[3]) or 0)
  if done >= total and not f[4] then
    local ms = string.format('%.0f', math.floor(now_us() / 1000))
    redis.call('HSET', key, 'completed_ms', ms, 'event', ms)
    return ms
  elseif done < total and f[4] then
    redis.call('HDEL', key, 'completed_ms', 'event')
    return ''
  end
  return f[5] or ''
end

-- The completion event for a message counted now in the batch whose progress is KEY: the
-- event if counting it completed the batch (see batch_event), else ''. A message counted after
-- its batch completed (one more than its total) leaves the event to the message that completed
-- it, which is not acked before the event is published (its redelivery publishes it if it
-- could not): two messages never race to publish it.
local function event_on_count(key)
  if key == nil then return '' end
  local completed_before = redis.call('HEXISTS', key, 'completed_ms') == 1
  local event = batch_event(key)
  if completed_before then return '' end
  return event
end

-- What a section of INFO says a counter is (0 when it does not say).
local function info_count(info, pattern)
  return tonumber(string.match(info, pattern)) or 0
end

-- This Redis server's run id (new at every start, different on every server), uptime in
-- seconds, and LOSSES: how often it may have lost keys since it started: keys evicted under
-- `maxmemory`, and FLUSHALL and FLUSHDB calls (INFO's counters, which CONFIG RESETSTAT resets).
-- Read once per call.
local server_info = nil
local function server()
  if server_info == nil then
    local ok, info = pcall(redis.call, 'INFO', 'server', 'stats', 'commandstats')
    if not ok then -- Redis before 7.0 takes one section at a time
      info = redis.call('INFO', 'server') .. redis.call('INFO', 'stats') ..
        redis.call('INFO', 'commandstats')
    end
    server_info = {
      run_id = string.match(info, 'run_id:(%x+)') or '',
      uptime = tonumber(string.match(info, 'uptime_in_seconds:(%d+)')),
      losses = info_count(info, '\nevicted_keys:(%d+)')
        + info_count(info, 'cmdstat_flushall:calls=(%d+)')
        + info_count(info, 'cmdstat_flushdb:calls=(%d+)'),
    }
  end
  return server_info
end

-- Since when (µs, Redis time) this server has had its current LOSSES, as first seen from this
-- hash slot: LOSS_KEY is the slot's loss marker ("RUN_ID LOSSES SINCE_US", no TTL, so that an
-- eviction under a volatile policy spares it; see Keyspace::losses). Every key lost went before
-- that moment. nil when the server has lost nothing since it started.
local function losses_since(loss_key, now)
  local s = server()
  if s.losses == 0 then return nil end
  if loss_key == nil then error({err = 'ERR turnstile: the loss marker key is missing'}) end
  local marker = redis.call('GET', loss_key)
  if marker then
    local run_id, losses, since = string.match(marker, '^(%x+) (%d+) (%d+)$')
    if run_id == s.run_id and tonumber(losses) == s.losses then return tonumber(since) end
  end
  redis.call('SET', loss_key, s.run_id .. ' ' .. s.losses .. ' ' .. string.format('%.0f', now))
  return now
end

-- A Redis that lost writes may have forgotten grants the downstream still counts: a restart
-- without persistence (everything lost), a restart from an older RDB snapshot or AOF with
-- `everysec` (the last writes lost), a replica promoted while it lagged, and, on a live server,
-- keys evicted under `maxmemory` or flushed. So, unless DURABLE (the operator says Redis loses
-- no acknowledged write), each seller's state is stamped with the server that wrote it and its
-- LOSSES then ("RUN_ID:LOSSES", STAMP_KEY, living as long as the state), and a seller asked
-- about when the stamp is not the current one is paused first:
--   * on a server that started less than SPAN ago, until SPAN after the start: every grant the
--     lost writes held was made before the start, so none of them is in any window by then;
--   * on a server up for longer whose stamp names another server (a replica promoted, data
--     moved), until SPAN from now: the former server's last grants were made before now;
--   * on a server that lost keys (evictions, a flush), until SPAN after the moment its current
--     LOSSES were first seen (losses_since): every grant lost was made before then. This holds
--     whether the seller's stamp went too or not;
--   * without a stamp on a server up for longer than SPAN that lost nothing: a new or long-idle
--     seller (or one whose very first writes were lost with a lagging replica: see README,
--     Faults).
-- (uptime is whole seconds: the start is taken as late as it can have been.)
-- Returns true when the seller's state was not vouched for by the current stamp.
local function check_server(stamp_key, state_key, pause_key, loss_key, span, now, durable)
  if durable then return false end
  local s = server()
  local current = s.run_id .. ':' .. s.losses
  local stamp = redis.call('GET', stamp_key)
  if stamp == current then return false end
  local until_us = 0
  if s.uptime ~= nil and s.uptime * 1000000 < span then
    until_us = now - s.uptime * 1000000 + span
  elseif stamp and string.match(stamp, '^[^:]*') ~= s.run_id then
    until_us = now + span
  end
  local lost = losses_since(loss_key, now)
  if lost ~= nil then until_us = math.max(until_us, lost + span) end
  if until_us > now then extend_pause(pause_key, until_us, now) end
  local ttl = math.max(redis.call('PTTL', state_key), math.floor(span / 1000)) + 1
  redis.call('SET', stamp_key, current, 'PX', ttl)
  return true
end

-- Keeps the server stamp as long as the state it vouches for (TTL in ms).
local function keep_stamp(stamp_key, ttl, durable)
  if not durable then redis.call('PEXPIRE', stamp_key, ttl) end
end

-- A reserved slot is bound to its TOKEN and COST: the seller's reserved set (member
-- held_name(TOKEN, COST), score SLOT) holds every reservation not yet redeemed, and redeem.lua
-- consumes the entry, so a reservation is good once, and only for the caller that holds its
-- token. An entry more than LATE past its slot (see lateness) can no longer be redeemed:
-- reserved_full prunes it before every new reservation, and the set expires LATE after its last
-- slot.
local function hold_reservation(key, token, cost, slot, now, late)
  -- (reserved_full has just pruned the entries more than LATE past their slot.)
  redis.call('ZADD', key, slot, held_name(token, cost))
  local last = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
  redis.call('PEXPIRE', key, math.floor((last - now + late) / 1000) + 1)
end

-- sliding-window: whether a reservation of COST more units would take the seller's log (KEY,
-- one member per unit) past MAX_RESERVED units beyond the most a window may hold. At one unit a
-- call the reserved set fills first, as before costs; with costs this bounds the log, and so the
-- seller's memory, to MAX_RESERVED + the largest COUNT + COST members however deep its backlog.
local function log_crowded(key, limits, cost)
  return redis.call('ZCARD', key) + cost > MAX_RESERVED + limits.max_count
end

-- A shadow limit (`limits set --shadow`): a stack judged beside the enforced one and never
-- enforced. SHADOW_KEY (hash, no TTL): `counts` and `windows` (as parse_limits takes them), and
-- how many decisions it `agree`d with, would have held back (`stricter`: the call was granted but
-- a shadow window had no room for it; `delay_ms` adds up by how long) or would have let go at once
-- (`looser`: the caller was told to wait, every shadow window had room). SHADOW_LOG_KEY (sorted
-- set): the units granted, score = grant time, within the shadow's longest window and at most its
-- largest COUNT of them (the newest: older ones cannot decide anything), and never more than
-- MAX_SHADOW_LOG (a shadow COUNT above it is refused when set). Windows are judged without a
-- guard. Sets a.verdict (the answer's last field); nothing without a shadow.
local MAX_SHADOW_LOG = 10000
local function judge_shadow(a, now, granted)
  if a.shadow == nil then return end
  local s = redis.call('HMGET', a.shadow, 'counts', 'windows')
  local limits = parse_limits(s[1], s[2])
  if limits == nil then return end
  with_spans(limits, 0)
  redis.call('ZREMRANGEBYSCORE', a.shadow_log, '-inf', now - limits.max_window)
  local wait = 0
  for _, l in ipairs(limits) do
    local room = l.count - a.cost
    if room < 0 then
      wait = math.max(wait, l.window)
    else
      local n = redis.call('ZCOUNT', a.shadow_log, string.format('(%.0f', now - l.window), '+inf')
      if n > room then
        local kth = tonumber(redis.call('ZREVRANGE', a.shadow_log, room, room, 'WITHSCORES')[2])
        wait = math.max(wait, kth + l.window - now)
      end
    end
  end
  local verdict = 'agree'
  if granted then
    if wait > 0 then
      verdict = 'stricter'
      redis.call('HINCRBY', a.shadow, 'delay_ms', math.ceil(wait / 1000))
    end
    add_units(a.shadow_log, now, a.token, a.cost)
    redis.call('ZREMRANGEBYRANK', a.shadow_log, 0, -(math.min(limits.max_count, MAX_SHADOW_LOG) + 1))
    redis.call('PEXPIRE', a.shadow_log, math.floor(limits.max_window / 1000) + 1)
  elseif wait == 0 then
    verdict = 'looser'
  end
  redis.call('HINCRBY', a.shadow, verdict, 1)
  a.verdict = verdict
end

-- The answer of the acquire scripts to a caller told to wait (STATUS 0 or 2) until SLOT.
local function told_to_wait(status, slot, now, limits, a)
  judge_shadow(a, now, false)
  return {status, slot, now, limits.counts, limits.windows, 0, a.verdict or ''}
end

-- The last step of every acquire script, once the seller's state was written to last TTL ms:
-- the server stamp STAMP_KEY lasts as long, the call (or reservation) takes its part of the
-- downstream's quota (take_quota), and a wait (STATUS 2) holds its reservation in RESERVED_KEY.
-- Returns the script's answer for a wait, nil for a grant (judged by the shadow limit).
local function keep_and_hold(status, ttl, stamp_key, reserved_key, slot, now, late, a, limits)
  keep_stamp(stamp_key, ttl, a.durable)
  take_quota(a.learned, limits, slot, a.cost, now)
  if status ~= 2 then
    judge_shadow(a, now, true)
    return nil
  end
  hold_reservation(reserved_key, a.token, a.cost, slot, now, late)
  return told_to_wait(2, slot, now, limits, a)
end

-- fixed-window: the field of the counter of window INDEX of the I-th limit L of a stack (the
-- index itself for the first limit, as earlier versions wrote it; WINDOW_US:INDEX for the
-- others), and the field of that limit's `next` (the first window that may still have room).
local function fw_field(i, l, index)
  if i == 1 then return string.format('%.0f', index) end
  return string.format('%.0f:%.0f', l.window, index)
end
local function fw_next(i, l)
  if i == 1 then return 'next' end
  return string.format('%.0f:next', l.window)
end

-- token-bucket: the field holding the I-th bucket's tokens (`tokens`, then `tokens2`, ...; the
-- buckets share the field `ts`, the µs at which they hold).
local function tb_field(i)
  if i == 1 then return 'tokens' end
  return 'tokens' .. i
end

-- token-bucket: each limit's bucket holds CAPACITY tokens when it is the only limit and
-- CAPACITY > 0, else its COUNT.
local function with_capacities(limits, capacity)
  for _, l in ipairs(limits) do
    l.capacity = l.count
    if #limits == 1 and capacity > 0 then l.capacity = capacity end
  end
  return limits
end

-- Gives the COST units reserved with TOKEN at SLOT (under the stack LIMITS) back to the seller's
-- state of ALGORITHM, so that the next caller may take them (the reservation itself is removed
-- from the reserved set by the caller):
--   sliding-window  its log entries (the units of TOKEN) are removed: exact;
--   fixed-window    each limit's counter of the slot's window goes down by COST, and the window
--                   is open again: exact;
--   token-bucket    COST tokens go back into each bucket (capped at its capacity; see
--                   with_capacities for LIMITS' capacities);
--   gcra            nothing: a TAT cannot free a slot inside its schedule; the slot stays unused
--                   (a capacity loss, never an excess). See reschedule.lua for giving back a
--                   whole schedule's reservations at once.
local function give_back(algorithm, state_key, token, cost, slot, limits)
  if algorithm == 'sliding-window' then
    remove_units(state_key, token, cost)
  elseif algorithm == 'fixed-window' then
    for i, l in ipairs(limits) do
      local index = math.floor(slot / l.window)
      local field = fw_field(i, l, index)
      local taken = tonumber(redis.call('HGET', state_key, field) or '0')
      if taken > 0 then
        redis.call('HINCRBY', state_key, field, -math.min(taken, cost))
        if index < tonumber(redis.call('HGET', state_key, fw_next(i, l)) or '0') then
          redis.call('HSET', state_key, fw_next(i, l), string.format('%.0f', index))
        end
      end
    end
  elseif algorithm == 'token-bucket' then
    for i, l in ipairs(limits) do
      local tokens = tonumber(redis.call('HGET', state_key, tb_field(i)) or '')
      if tokens ~= nil then
        redis.call('HSET', state_key, tb_field(i), string.format('%.6f', math.min(tokens + cost, l.capacity)))
      end
    end
  end
end

-- Whether the seller's reserved set is full (see MAX_RESERVED), once entries that can no longer
-- be redeemed (more than LATE past their slot, see lateness) are pruned. No call was made with
-- a pruned entry (redeeming removes it first), so its units go back to ALGORITHM's state
-- STATE_KEY (see give_back): a message that never came back for its slot (lost with a replica,
-- a refused publish) costs the seller no capacity beyond its slot.
local function reserved_full(reserved_key, now, late, state_key, algorithm, limits)
  local stale = redis.call('ZRANGEBYSCORE', reserved_key, '-inf', string.format('%.0f', now - late), 'WITHSCORES')
  for i = 1, #stale, 2 do
    local token, cost = held_parts(stale[i])
    give_back(algorithm, state_key, token, cost, tonumber(stale[i + 1]), limits)
  end
  redis.call('ZREMRANGEBYSCORE', reserved_key, '-inf', string.format('%.0f', now - late))
  return redis.call('ZCARD', reserved_key) >= MAX_RESERVED
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

-- ARGV[i] as one of the algorithms, or the script fails before anything is written.
local function algorithm_arg(i)
  local a = ARGV[i]
  if a ~= 'sliding-window' and a ~= 'gcra' and a ~= 'token-bucket' and a ~= 'fixed-window' then
    error({err = 'ERR turnstile: ARGV[' .. i .. '] must be an algorithm'})
  end
  return a
end

-- Calls (the exact algorithms): every call granted occupies the time from its grant until its
-- answer, because the downstream may count it at any moment in between. The seller's calls
-- (sorted set CALLS: the units of each call TOKEN, see unit; score = the call's END: while it
-- is in flight, its grant + BOUND, the latest its answer or timeout can come back; once
-- answered, when its answer came back, see ended.lua) keep every call whose END lies within
-- the stack's longest window: a call that ended earlier cannot share a window with one starting
-- now. A new call of COST units may start only while, for every limit, the units whose END lies
-- within its WINDOW leave room for COST more; then, whatever each call's latency, no window of
-- the downstream holds more than COUNT units of any limit (README, "Exact whatever the
-- latency").
-- Returns nil when a call may start now, else when to ask again: when enough ENDs leave every
-- window if every call in flight takes its whole BOUND, but no later than GUARD from now (an
-- answer usually comes much sooner).
local function calls_gate(calls_key, now, limits, cost)
  redis.call('ZREMRANGEBYSCORE', calls_key, '-inf', now - limits.max_window)
  local open_at = nil
  for _, l in ipairs(limits) do
    local n = redis.call('ZCOUNT', calls_key, string.format('(%.0f', now - l.window), '+inf')
    l.in_flight = n
    local room = l.count - cost
    if n > room then
      local kth = tonumber(redis.call('ZREVRANGE', calls_key, room, room, 'WITHSCORES')[2])
      open_at = math.max(open_at or 0, kth + l.window)
    end
  end
  if open_at == nil then return nil end
  return math.min(open_at, now + math.max(limits.min_guard, 1000))
end

-- A due STATUS (1) held back by calls_gate becomes a reservation at the time the gate may open
-- (or a denial, come back then, when the caller does not reserve). Returns SLOT, STATUS.
local function after_gate(status, slot, calls_key, now, limits, a)
  if status ~= 1 then return slot, status end
  local open_at = calls_gate(calls_key, now, limits, a.cost)
  if not open_at then return slot, status end
  return math.max(open_at, slot), (a.reserve == 1 and 2 or 0)
end

-- Keeps the seller's calls (CALLS_KEY) at least LAST µs from now, never shortening what it
-- had: a permit block's units end later than a call granted now (see take_block).
local function keep_calls(calls_key, last)
  local ttl = math.floor(last / 1000) + 1
  if redis.call('PTTL', calls_key) < ttl then redis.call('PEXPIRE', calls_key, ttl) end
end

-- Records a call of COST units granted now with TOKEN: in flight until now + BOUND at the latest.
local function start_call(calls_key, token, cost, now, bound, limits)
  add_units(calls_key, now + bound, token, cost)
  keep_calls(calls_key, bound + limits.max_window)
end

-- Records that the call TOKEN was answered at AT (see answered_arg): the END of each of its
-- units comes forward to AT (never back). With its COST known (>= 1) exactly its units move;
-- without (0), they are moved 64 at a time (ZADD XX touches only those that exist) until a batch
-- finds fewer: a few calls for any cost.
local function end_call(calls_key, token, at, cost)
  local bound = tonumber(redis.call('ZSCORE', calls_key, token) or '')
  if bound == nil or at >= bound then return end
  redis.call('ZADD', calls_key, at, token)
  if cost >= 1 then
    if cost > 1 then
      local args = {}
      for i = 2, cost do
        args[#args + 1] = at
        args[#args + 1] = unit(token, i)
      end
      redis.call('ZADD', calls_key, 'XX', unpack(args))
    end
    return
  end
  local first = 2
  repeat
    local args = {}
    for i = first, first + 63 do
      args[#args + 1] = at
      args[#args + 1] = unit(token, i)
    end
    local moved = redis.call('ZADD', calls_key, 'XX', 'CH', unpack(args))
    first = first + 64
  until moved < 64
end

-- Most units of a permit block (see take_block) besides the call that asks for it.
local MAX_BLOCK = 64

-- The name of unit I of the permit block of the call TOKEN: a call of its own, of one unit, in
-- the seller's log and calls (see take_block); unit 1 is the call TOKEN itself.
local function block_unit(token, i)
  if i == 1 then return token end
  return token .. '-' .. i
end

-- Permit blocks (sliding-window): a call of one unit granted now (TOKEN, already in the log and
-- in flight) may take up to WANT more units at once into the seller's pool of unclaimed units
-- (BLOCKED_KEY, score = the unit's END, NOW + HOLD + BOUND), for the next calls of the seller by
-- any replica: each is claimed (taken out of the pool) by an acquire (claim_idle) or by a
-- replica's plain ZPOPMIN, and used only if the claimer's call, bounded from before its claim
-- by its own BOUND, answers by END (the acquire checks on Redis's clock; a plain claim on
-- Redis's TIME read in the same pipeline, after the call was asked for).
-- Only while the seller is far from its limits: no reservation waiting (RESERVED_KEY empty), no
-- shadow limit, no learned limit or quota applying (see with_learned), and, for every limit of
-- the stack, the units in the log within its span and the calls of the calls gate within its
-- window (see calls_gate), block included, at most half its COUNT; the second half is granted
-- call by call, with reservations, as before. A block is at most a quarter of every COUNT (a
-- stack with a COUNT below 8 takes none). Each unit (block_unit(TOKEN, I)) is in the log at NOW
-- and in flight in the calls until NOW + HOLD + BOUND, the latest a call made with it can
-- answer (keep_calls: the calls set lives at least as long): the
-- calls gate counts it, wherever in that time it is used, exactly as a call of that latency
-- (README, "Permit blocks"). Until it is claimed, an acquire short of room may reclaim it
-- (reclaim_idle): units no one uses never keep a call waiting. Returns how many units were
-- taken (0: none).
local function take_block(a, limits, log_key, reserved_key, calls_key, blocked_key, now, want, hold)
  if want < 1 or a.cost ~= 1 or limits.configured ~= nil or limits.quota_until ~= nil then return 0 end
  if redis.call('EXISTS', reserved_key) == 1 then return 0 end
  if a.shadow ~= nil and redis.call('EXISTS', a.shadow) == 1 then return 0 end
  local n = math.min(want, MAX_BLOCK)
  if limits.min_count < 8 then return 0 end
  for _, l in ipairs(limits) do
    -- As the grant counted them (l.logged, l.in_flight: see fit and calls_gate), with it.
    local logged = l.logged or redis.call('ZCOUNT', log_key, string.format('(%.0f', now - l.span), '+inf')
    local calls = l.in_flight or redis.call('ZCOUNT', calls_key, string.format('(%.0f', now - l.window), '+inf')
    n = math.min(n, math.floor(l.count / 4), math.floor(l.count / 2) - math.max(logged, calls) - 1)
  end
  if n < 1 then return 0 end
  local logged, in_flight, idle = {}, {}, {}
  local ends = string.format('%.0f', now + hold + a.bound)
  for i = 2, n + 1 do
    local unit = block_unit(a.token, i)
    logged[#logged + 1] = now
    logged[#logged + 1] = unit
    in_flight[#in_flight + 1] = ends
    in_flight[#in_flight + 1] = unit
    idle[#idle + 1] = ends
    idle[#idle + 1] = unit
  end
  redis.call('ZADD', log_key, unpack(logged))
  redis.call('ZADD', calls_key, unpack(in_flight))
  keep_calls(calls_key, hold + a.bound + limits.max_window)
  redis.call('ZADD', blocked_key, unpack(idle))
  -- The pool outlives the hold (by the longest span or the bound, if longer): a later acquire
  -- gives back the units no call used (claim_idle); the last ones leave the log by themselves.
  local pool_ttl = math.floor((hold + math.max(limits.max_span, a.bound)) / 1000) + 1
  if redis.call('PTTL', blocked_key) < pool_ttl then redis.call('PEXPIRE', blocked_key, pool_ttl) end
  return n
end

-- Claims a unit of the seller's pool (BLOCKED_KEY, see take_block) for a call asked for before
-- NOW that answers within BOUND of being asked for: first every unit that such a call could
-- outlive (END < NOW + BOUND: its hold is over) is given back (it leaves the pool, the log and
-- the calls), then the unit that ends first is taken out of the pool; the call answers by its
-- END. Returns the unit (nil: none) with its END, and how many stale units were given back.
local function claim_idle(blocked_key, log_key, calls_key, now, bound)
  local stale = redis.call('ZRANGEBYSCORE', blocked_key, '-inf', string.format('(%.0f', now + bound))
  for first = 1, #stale, 1000 do
    local last = math.min(first + 999, #stale)
    redis.call('ZREM', blocked_key, unpack(stale, first, last))
    redis.call('ZREM', log_key, unpack(stale, first, last))
    redis.call('ZREM', calls_key, unpack(stale, first, last))
  end
  local next = redis.call('ZPOPMIN', blocked_key)
  if #next == 0 then return nil, 0, #stale end
  return next[1], tonumber(next[2]), #stale
end

-- Takes back every permit-block unit of the seller not claimed yet (BLOCKED_KEY, see
-- take_block): they leave the log and the calls, and a replica's claim of one now fails (it
-- asks again instead). Returns how many were taken back.
local function reclaim_idle(blocked_key, log_key, calls_key)
  if blocked_key == nil then return 0 end
  local idle = redis.call('ZRANGE', blocked_key, 0, -1)
  if #idle == 0 then return 0 end
  redis.call('DEL', blocked_key)
  for first = 1, #idle, 1000 do
    local last = math.min(first + 999, #idle)
    redis.call('ZREM', log_key, unpack(idle, first, last))
    redis.call('ZREM', calls_key, unpack(idle, first, last))
  end
  return #idle
end

-- Gives back every slot reserved by the seller (RESERVED_KEY, emptied) to its state of ALGORITHM
-- (STATE_KEY), made under the stack LIMITS, and brings that state to the stack NEW_LIMITS that
-- applies from now on (BURST: gcra's). Returns how many reservations were given back.
--   sliding-window  every reserved unit leaves the log: exact;
--   fixed-window    every reserved slot's units leave its windows' counters: exact;
--   token-bucket    the buckets are brought to now, every reserved unit goes back into each
--                   (between 0 and its capacity: only reservations run into debt);
--   gcra            each limit's TAT moves back by one emission interval per reserved unit
--                   whose slot lies after every call made (later than GUARD/10 from now): those
--                   are the end of the schedule (a grant is only made when no slot lies ahead),
--                   so what is left is the schedule of the calls, at most BURST intervals past
--                   the latest a grant may be (a pause folded into the TAT ends there); the most
--                   cells any limit still holds are then spaced at each new limit's interval, at
--                   most one new window ahead (by then every earlier call has left any window).
--   fixed-window counters are kept per window index: a new WINDOW length starts new indexes
--   (the old counts no longer apply; fixed-window is not exact across its edges anyway).
local function give_back_reserved(algorithm, state_key, reserved_key, limits, new_limits, now, burst)
  local reserved = redis.call('ZRANGE', reserved_key, 0, -1, 'WITHSCORES')
  local released = #reserved / 2
  local function units_of(members)
    local units = 0
    for i = 1, #members, 2 do
      local _, cost = held_parts(members[i])
      units = units + cost
    end
    return units
  end
  if algorithm == 'gcra' then
    local value = redis.call('GET', state_key)
    if value then
      local stored, latest = {}, 0
      for t in string.gmatch(value, '[^,]+') do
        stored[#stored + 1] = tonumber(t) or 0
        latest = math.max(latest, stored[#stored])
      end
      -- Only units slotted after every call made so far (later than the earliest a grant may be)
      -- are the end of the schedule; an older, unredeemed one stays unused.
      local early = math.floor(limits.min_guard / 10)
      local ahead = units_of(redis.call('ZRANGEBYSCORE', reserved_key, string.format('(%.0f', now + early), '+inf', 'WITHSCORES'))
      local cells = 0
      for i, l in ipairs(limits) do
        local b = math.min(burst, l.count)
        local interval = l.span / (l.count - b + 1)
        -- A grant is only made with its slot at most GUARD/10 ahead, so the calls' TAT is at most
        -- BURST intervals past that (a pause folded into the TAT ends there too).
        local calls_tat = math.min((stored[i] or latest) - ahead * interval, now + early + b * interval)
        cells = math.max(cells, math.max(calls_tat - now, 0) / interval)
      end
      -- The calls' cells, spaced at each new interval, never more than one new window ahead.
      local tats, longest = {}, 0
      for i, l in ipairs(new_limits) do
        local b = math.min(burst, l.count)
        local ahead_us = math.min(cells * l.span / (l.count - b + 1), l.span)
        tats[i] = string.format('%.0f', now + ahead_us)
        longest = math.max(longest, ahead_us)
      end
      if longest > 0 then
        redis.call('SET', state_key, table.concat(tats, ','), 'PX', math.floor(longest / 1000) + 1)
      else
        redis.call('DEL', state_key)
      end
    end
  elseif algorithm == 'token-bucket' then
    local fields = {'ts'}
    for i = 1, #limits do fields[i + 1] = tb_field(i) end
    local state = redis.call('HMGET', state_key, unpack(fields))
    local ts = tonumber(state[1])
    if ts ~= nil then
      -- The buckets now, with the reserved units back. Only reservations run into debt (a grant
      -- needs the tokens at its slot, at most GUARD/10 ahead), so once they are all given back
      -- each bucket now holds at least nothing; a pause folded into TS is dropped the same way.
      local units = units_of(reserved)
      local write = {'ts', string.format('%.0f', now)}
      for i, l in ipairs(limits) do
        local tokens = tonumber(state[i + 1])
        if tokens ~= nil then
          local filled = tokens + (now - ts) * l.count / l.span + units
          write[#write + 1] = tb_field(i)
          write[#write + 1] = string.format('%.6f', math.min(math.max(filled, 0), l.capacity))
        end
      end
      redis.call('HSET', state_key, unpack(write))
    end
  else
    for i = 1, #reserved, 2 do
      local token, cost = held_parts(reserved[i])
      give_back(algorithm, state_key, token, cost, tonumber(reserved[i + 1]), limits)
    end
    -- The windows are looked at again from now: a new COUNT may leave room in a full one.
    if algorithm == 'fixed-window' then
      for i, l in ipairs(limits) do redis.call('HDEL', state_key, fw_next(i, l)) end
    end
  end
  redis.call('DEL', reserved_key)
  return released
end

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
-- answered, and returns 1 when a learned count is due to go up (raise_due), else 0.
local function note_accepted(learned_key, accepted_key, configured, token, cost, now)
  redis.call('ZREMRANGEBYSCORE', accepted_key, '-inf', now - configured.max_span)
  add_units(accepted_key, now, token, cost)
  redis.call('ZREMRANGEBYRANK', accepted_key, 0, -(2 * configured.max_count + cost + 1))
  redis.call('PEXPIRE', accepted_key, math.floor(configured.max_span / 1000) + 1)
  if redis.call('EXISTS', learned_key) == 0 then return 0 end
  if redis.call('PTTL', learned_key) < learned_ttl(configured) then
    redis.call('PEXPIRE', learned_key, learned_ttl(configured))
  end
  if #raise_due(learned_state(learned_key, configured), configured, accepted_key, now) > 0 then
    return 1
  end
  return 0
end

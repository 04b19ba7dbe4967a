-- @include args
-- @include batches
-- @include calls
-- @include learned
-- @include limits
-- @include records
-- @include terms
-- @include time
-- complete: moves a message to the state it is in now, and counts it there once. The message's
-- completion record holds its state:
--   (none)          waiting: published, neither registered nor dead-lettered (or replayed since)
--   registered      registered; a redelivery is acked without a second call (see already_done);
--                   `registered <RESULT>` while its result is not yet published (see RESULT)
--   dead:<REASON>   dead-lettered for REASON and not replayed since
-- Its batch's progress counts each message in at most one of `registered` and `dead` (and
-- `dead:<REASON>`), so waiting = total - registered - dead.
--
-- Transitions: MOVES below, written in by src/permit/scripts.rs from TRANSITIONS in
-- src/permit/calls/complete.rs (their one list): registered moves waiting or dead to
-- registered, dead moves waiting to dead, replayed moves dead to waiting (the record deleted,
-- before the replay republishes it); any other changes nothing and counts nothing (a repeated
-- dead letter only renews the record's TTL). A move takes the message out of the counts of the
-- state it leaves (dead: `dead` and `dead:<REASON>` - 1) and counts it in the state it enters
-- (registered: `registered` + 1; dead: `dead` and `dead:<REASON>` + 1). A count is never taken
-- below zero, and a batch that no longer exists is not recreated by a decrement.
--
-- A batch with a known total (the first BATCH_SIZE given, see batch_seen.lua) is complete when
-- registered + dead reaches it: `completed_ms` and `event` (its completion event, to publish)
-- are set once. A replay that takes it below its total opens it again (both removed); it then
-- completes again. The caller publishes the event and removes `event` (batch_event_sent.lua).
-- EVENT goes to the message whose count completed the batch, and to a repeat of a message
-- already counted (its redelivery, when it could not publish the event), never to a message
-- counted after the batch completed (one more than its total): see event_on_count.
--
-- KEYS[1]  the message's completion record (string)
-- KEYS[2]  the seller's calls (see calls_gate in include/calls.lua): with `registered` and a
--          CALL, the call's answer is recorded now (see end_call)
-- KEYS[3]  with ADAPTIVE: the seller's learned state (see learn.lua)
-- KEYS[4]  with ADAPTIVE: the seller's accepted log (see note_accepted in include/learned.lua)
-- KEYS[5]  with ADAPTIVE: the seller's limit override, may be absent
-- KEYS[6] (KEYS[3] without ADAPTIVE)  optional: the batch's progress (hash: seller, batch,
--          total, registered, dead, dead:<REASON>, done_units, first_ms, last_ms,
--          completed_ms, event)
-- ARGV[1]  TTL of both, in ms (integer >= 1)
-- ARGV[2]  OUTCOME: `registered`, `dead` or `replayed`
-- ARGV[3]  with `dead`: REASON (1 to 64 letters, digits or dashes); else ignored
-- ARGV[4]  CALL: the token of the call that registered it ('' when none)
-- ARGV[5]  ANSWERED_US: when the CALL's answer came (see answered_arg in include/args.lua;
--          -1 = now): its end in the seller's calls and its time in the accepted log
-- ARGV[6]  COST of the message (integer from 0 to MAX_COST; 0 or absent = not known, see
--          end_call; ADAPTIVE needs it): its units in the batch's `done_units`
-- ARGV[7]  ADAPTIVE: 1 = adaptive limits on: a CALL's acceptance is noted in the accepted log
--          (note_accepted); else 0 or absent (ARGV[8] to ARGV[10] may then be absent too)
-- ARGV[8]  with ADAPTIVE: default COUNTS, comma-separated; else ignored
-- ARGV[9]  with ADAPTIVE: default WINDOWS in µs, comma-separated; else ignored
-- ARGV[10] with ADAPTIVE: GUARD in µs (-1 = window/20 within [25 ms, 2 s]); else ignored
-- ARGV[11] with a batch: SELLER, the seller's id as text (1 to 512 bytes)
-- ARGV[12] with a batch: BATCH, the batch's id as text (1 to 1024 bytes)
-- ARGV[13] with a batch: BATCH_SIZE, the message's batch_size (integer 0 to 1000000; 0 = none)
-- ARGV[14] with `registered`, optional: RESULT, the message's result (JSON, at most 1 MiB) kept
--          in the record until it is published (the record reads `registered <RESULT>`); ''
--          or absent: none. ARGV[11] to ARGV[13] are then given even without a batch (ignored).
-- Returns {CHANGED, WAS_DEAD_FOR, RAISE, EVENT}: CHANGED 1 when the state changed (and was
--   counted), else 0; WAS_DEAD_FOR the REASON the message was dead for when it left `dead`,
--   else ''; RAISE 1 when a learned count is due to change (learn.lua, `recovery`), else 0;
--   EVENT the batch's completion event to publish (its `completed_ms`, see above) or ''
--   when none

local ttl = int_arg(1, 1)
local outcome = ARGV[2]
if outcome ~= 'registered' and outcome ~= 'dead' and outcome ~= 'replayed' then
  error({err = 'ERR turnstile: OUTCOME must be registered, dead or replayed'})
end
local reason = ARGV[3]
if outcome == 'dead' and (reason == nil or not string.match(reason, '^[%w-]+$') or #reason > 64) then
  error({err = 'ERR turnstile: REASON must be 1 to 64 letters, digits or dashes'})
end

local adaptive = ARGV[7] == '1'
local batch_key = KEYS[3]
local cost = 0
if ARGV[6] ~= nil then cost = int_arg(6, 0) end
if cost > MAX_COST then error({err = 'ERR turnstile: COST must be at most ' .. MAX_COST}) end
local default, guard = nil, nil
if adaptive then
  batch_key = KEYS[6]
  default, guard = limits_arg(8), int_arg(10, -1)
  if cost < 1 then error({err = 'ERR turnstile: COST must be >= 1 with ADAPTIVE'}) end
end
local batch = nil
if batch_key ~= nil then batch = batch_args(11) end
local result = ARGV[14] or ''
if #result > 1048576 then error({err = 'ERR turnstile: RESULT must be at most 1 MiB'}) end

-- MOVES[OUTCOME][FROM]: the state OUTCOME moves a record in state FROM (`waiting`,
-- `registered` or `dead`) to; none: it stays.
local MOVES = from_rust('TRANSITIONS')

local state = redis.call('GET', KEYS[1])
local dead_for = state and string.match(state, '^dead:(.+)$')
local from = 'waiting'
if is_registered(state) then from = 'registered' elseif dead_for then from = 'dead' end

-- Counts the message `by` (+1 or -1) in the batch's FIELDS; a decrement only where each field
-- holds the message, and never into a batch that no longer exists.
local function count(fields, by)
  if batch_key == nil then return end
  if by < 0 then
    for _, field in ipairs(fields) do
      if tonumber(redis.call('HGET', batch_key, field) or '0') < -by then return end
    end
  else
    describe_batch(batch_key, batch)
  end
  for _, field in ipairs(fields) do redis.call('HINCRBY', batch_key, field, by) end
  redis.call('HINCRBY', batch_key, 'done_units', by * math.max(cost, 1))
  redis.call('HSET', batch_key, 'last_ms', math.floor(now_us() / 1000))
  redis.call('PEXPIRE', batch_key, ttl)
end

local raise = 0
local call = ARGV[4] or ''
if outcome == 'registered' and call ~= '' then
  local token = token_arg(4)
  local answered = answered_arg(5, now_us())
  end_call(KEYS[2], token, answered, cost)
  if adaptive then
    local configured = with_spans(effective_limits(KEYS[5], default), guard)
    raise = note_accepted(KEYS[3], KEYS[4], configured, call, cost, answered)
  end
end

local to = MOVES[outcome][from]
if to == nil then
  if outcome == 'dead' and from == 'dead' then redis.call('PEXPIRE', KEYS[1], ttl) end
  if outcome == 'replayed' then return {0, '', 0, ''} end
  return {0, '', raise, batch_event(batch_key)}
end
if to == 'waiting' then
  redis.call('DEL', KEYS[1])
elseif to == 'dead' then
  redis.call('SET', KEYS[1], 'dead:' .. reason, 'PX', ttl)
elseif result == '' then
  redis.call('SET', KEYS[1], 'registered', 'PX', ttl)
else
  redis.call('SET', KEYS[1], 'registered ' .. result, 'PX', ttl)
end
if from == 'dead' then count({'dead', 'dead:' .. dead_for}, -1) end
if to == 'registered' then
  count({'registered'}, 1)
elseif to == 'dead' then
  count({'dead', 'dead:' .. reason}, 1)
end
-- A message counted may complete its batch (event_on_count); one a replay takes out of it may
-- open it again (batch_event).
if to == 'waiting' then return {1, dead_for, 0, batch_event(batch_key)} end
return {1, dead_for or '', raise, event_on_count(batch_key)}

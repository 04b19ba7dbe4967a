-- @include args
-- supersede: which message of one seller's product (its `product_key`) is the latest, decided
-- atomically for every replica. A newer message supersedes every older one whose call has not
-- started; an older one that arrives after a newer is superseded at once; a message whose call
-- started is never superseded. Newer: a higher VERSION when both carry one, otherwise a later
-- first arrival (the order in which any replica first brought the message here).
--
-- The latest's reservation, while it waits for its slot, is kept here (STEP `reserved`): a
-- newer message with the same SIGNATURE (cost and route) that supersedes it takes the
-- reservation over (STEP `arrive` answers it, and answers it again to a repeated `arrive` until
-- the newer message notes a reservation or starts its call), so the seller's schedule keeps its
-- place rather than losing the slot. The superseded message hears `taken` only while it holds
-- that very reservation (HELD): any other it holds it gives back.
--
-- KEYS[1]  the product's record (hash): `seq` (arrivals), `latest` (its message id),
--          `m:<ID>` ("SEQ" or "SEQ VERSION": each message remembered), `c:<ID>` (its call
--          started), `a:<ID>` (the TOKEN of its reservation a newer message took over),
--          `t:<ID>` ("FROM\nRESERVATION": the reservation it took over, until it notes one or
--          starts), `r` (the latest's reservation: "ID\nSIGNATURE\nTOKEN\nRESERVATION")
-- KEYS[2]  the product's arrivals (sorted set: message id -> SEQ): at most MAX_REMEMBERED
--          messages are remembered; the oldest arrival (never the latest) is forgotten first
-- ARGV[1]  STEP: `arrive` (a delivery of the message begins), `reserved` (it holds the
--          reservation RESERVATION, token HELD), `start` (its call is about to start),
--          `unstart` (no call followed a `start`), `revive` (an operator replays it: it becomes
--          the latest) or `unrevive` (that replay failed: PREVIOUS is the latest again)
-- ARGV[2]  the message's ID (1 to 1024 bytes)
-- ARGV[3]  its VERSION: '' for none, else an integer of at most 15 digits, optionally signed
-- ARGV[4]  TTL in ms (integer from 1 to MAX_TTL_MS): both keys expire TTL after the last step
-- ARGV[5]  SIGNATURE: what a reservation must match to be taken over (at most 300 bytes, no
--          newline)
-- ARGV[6]  HELD: the TOKEN of the reservation the message holds ('' for none; else 1 to 64
--          letters, digits or dashes)
-- ARGV[7]  with `reserved`: the RESERVATION as it travels in a header (1 to 4096 bytes, no
--          newline); with `unrevive`: PREVIOUS, the latest before the replay ('' for none)
-- Returns {VERDICT, BY, RESERVATION}
--   VERDICT 'go': the message proceeds; with `arrive`, RESERVATION (else '') is the reservation
--   of the message BY it superseded, now its own; with `revive`, BY is the latest before it.
--   VERDICT 'superseded': BY is the latest's id; RESERVATION is 'taken' when the reservation
--   it holds (HELD) went to a newer message (it must not give it back), else ''.

local MAX_REMEMBERED = 1024
local MAX_TTL_MS = 315360000000

local step = ARGV[1]
local steps = {arrive = true, reserved = true, start = true, unstart = true, revive = true,
  unrevive = true}
if step == nil or not steps[step] then
  error({err = 'ERR turnstile: STEP must be arrive, reserved, start, unstart, revive or unrevive'})
end
local id = ARGV[2]
if id == nil or #id < 1 or #id > 1024 then
  error({err = 'ERR turnstile: ID must be 1 to 1024 bytes'})
end
local version = ARGV[3] or ''
local digits = string.match(version, '^%-?(%d+)$')
if version ~= '' and (digits == nil or #digits > 15) then
  error({err = 'ERR turnstile: VERSION must be empty or an integer of at most 15 digits'})
end
local ttl = int_arg(4, 1)
if ttl > MAX_TTL_MS then error({err = 'ERR turnstile: TTL must be at most ' .. MAX_TTL_MS}) end
local signature = ARGV[5] or ''
if #signature > 300 or string.find(signature, '\n', 1, true) then
  error({err = 'ERR turnstile: SIGNATURE must be at most 300 bytes without a newline'})
end
local held = ARGV[6] or ''
if held ~= '' and (not string.match(held, '^[%w-]+$') or #held > 64) then
  error({err = 'ERR turnstile: HELD must be empty or 1 to 64 letters, digits or dashes'})
end
local extra = ARGV[7] or ''
if #extra > 4096 or string.find(extra, '\n', 1, true) then
  error({err = 'ERR turnstile: ARGV[7] must be at most 4096 bytes without a newline'})
end
if step == 'reserved' and (extra == '' or held == '') then
  error({err = 'ERR turnstile: reserved needs HELD and RESERVATION'})
end

local key, arrivals = KEYS[1], KEYS[2]
local function touched(answer)
  redis.call('PEXPIRE', key, ttl)
  redis.call('PEXPIRE', arrivals, ttl)
  return answer
end

local latest = redis.call('HGET', key, 'latest')
if latest == false then latest = nil end
local started = redis.call('HEXISTS', key, 'c:' .. id) == 1

local function superseded(by)
  local taken = ''
  if held ~= '' and redis.call('HGET', key, 'a:' .. id) == held then taken = 'taken' end
  return touched({'superseded', by or '', taken})
end

-- Remembers the message's arrival (once); forgets the oldest arrival but the latest beyond
-- MAX_REMEMBERED. Answers what it remembers: "SEQ" or "SEQ VERSION".
local function remembered()
  local seen = redis.call('HGET', key, 'm:' .. id)
  if seen ~= false then return seen end
  local seq = redis.call('HINCRBY', key, 'seq', 1)
  seen = tostring(seq)
  if version ~= '' then seen = seen .. ' ' .. version end
  redis.call('HSET', key, 'm:' .. id, seen)
  redis.call('ZADD', arrivals, seq, id)
  if redis.call('ZCARD', arrivals) > MAX_REMEMBERED then
    local now_latest = redis.call('HGET', key, 'latest')
    local oldest = redis.call('ZRANGE', arrivals, 0, 1)
    local forgotten = oldest[1]
    if forgotten == now_latest or forgotten == id then forgotten = oldest[2] end
    if forgotten ~= nil and forgotten ~= now_latest and forgotten ~= id then
      redis.call('ZREM', arrivals, forgotten)
      redis.call('HDEL', key, 'm:' .. forgotten, 'c:' .. forgotten, 'a:' .. forgotten,
        't:' .. forgotten)
    end
  end
  return seen
end

-- "SEQ" or "SEQ VERSION" as {seq, version or nil}.
local function order_of(seen)
  local seq, v = string.match(seen, '^(%d+) ?(%-?%d*)$')
  if seq == nil then return nil end
  if v == '' then v = nil end
  return {tonumber(seq), v and tonumber(v)}
end

-- Whether a message remembered as A is newer than one remembered as B.
local function newer(a, b)
  if a[2] ~= nil and b[2] ~= nil and a[2] ~= b[2] then return a[2] > b[2] end
  return a[1] > b[1]
end

-- The message becomes the latest (a record lost or expired has none: the message asking is it).
local function become_latest()
  remembered()
  redis.call('HSET', key, 'latest', id)
end

if step == 'revive' then
  become_latest()
  redis.call('HDEL', key, 'a:' .. id, 't:' .. id, 'c:' .. id, 'r')
  return touched({'go', latest or '', ''})
end

if step == 'unrevive' then
  if latest == id then
    if extra ~= '' then
      redis.call('HSET', key, 'latest', extra)
    else
      redis.call('HDEL', key, 'latest')
    end
  end
  return touched({'go', '', ''})
end

if step == 'unstart' then
  redis.call('HDEL', key, 'c:' .. id)
  return touched({'go', '', ''})
end

if step == 'start' then
  if started then return touched({'go', '', ''}) end
  if latest ~= nil and latest ~= id then return superseded(latest) end
  become_latest()
  redis.call('HSET', key, 'c:' .. id, '1')
  redis.call('HDEL', key, 't:' .. id)
  local r = redis.call('HGET', key, 'r')
  if r ~= false and string.sub(r, 1, #id + 1) == id .. '\n' then redis.call('HDEL', key, 'r') end
  return touched({'go', '', ''})
end

if step == 'reserved' then
  if started then return touched({'go', '', ''}) end
  if latest ~= nil and latest ~= id then return superseded(latest) end
  become_latest()
  redis.call('HSET', key, 'r', id .. '\n' .. signature .. '\n' .. held .. '\n' .. extra)
  redis.call('HDEL', key, 't:' .. id)
  return touched({'go', '', ''})
end

-- arrive
if started then return touched({'go', '', ''}) end
local seen = redis.call('HGET', key, 'm:' .. id)
if seen ~= false then
  if latest ~= nil and latest ~= id then return superseded(latest) end
  redis.call('HSET', key, 'latest', id)
  -- A repeated arrive (its answer lost, a copy) hears the reservation it took over again.
  local pending = redis.call('HGET', key, 't:' .. id)
  if pending ~= false then
    local from, encoded = string.match(pending, '^([^\n]*)\n(.*)$')
    if from ~= nil then return touched({'go', from, encoded}) end
  end
  return touched({'go', '', ''})
end
local mine = remembered()
local theirs = latest and redis.call('HGET', key, 'm:' .. latest)
local their_order = theirs and order_of(theirs)
if latest ~= nil and their_order ~= nil and not newer(order_of(mine), their_order) then
  return superseded(latest)
end
redis.call('HSET', key, 'latest', id)
if latest == nil or redis.call('HEXISTS', key, 'c:' .. latest) == 1 then
  return touched({'go', '', ''})
end
-- The latest until now is superseded; its reservation, if it matches, is this message's now.
local r = redis.call('HGET', key, 'r')
redis.call('HDEL', key, 'r')
if r ~= false then
  local holder, sig, token, encoded = string.match(r, '^([^\n]*)\n([^\n]*)\n([^\n]*)\n(.*)$')
  if holder == latest and sig == signature and token ~= '' and encoded ~= nil
      and encoded ~= '' then
    redis.call('HSET', key, 'a:' .. latest, token, 't:' .. id, latest .. '\n' .. encoded)
    return touched({'go', latest, encoded})
  end
end
return touched({'go', latest, ''})

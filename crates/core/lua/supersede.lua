-- @include args
-- supersede: which message of one seller's product (its `product_key`) is the latest, decided
-- atomically for every replica. A newer message supersedes every older one whose call has not
-- started; an older one that arrives after a newer is superseded at once; a message whose call
-- started is never superseded. Newer: a higher VERSION when both carry one, otherwise a later
-- first arrival (the order in which any replica first brought the message here).
--
-- The latest's reservation, while it waits for its slot, is kept here (STEP `reserved`): a
-- newer message with the same SIGNATURE (cost and route) that supersedes it takes the
-- reservation over (STEP `arrive` answers it), so the seller's schedule keeps its place rather
-- than losing the slot to whoever asks first when the superseded message comes back.
--
-- KEYS[1]  the product's record (hash): `seq` (arrivals), `latest` (its message id),
--          `m:<ID>` ("SEQ" or "SEQ VERSION": each message seen), `c:<ID>` (its call started),
--          `a:<ID>` (its reservation was taken over), `r` (the latest's reservation:
--          "ID\nSIGNATURE\nRESERVATION"); it expires TTL after its last write
-- ARGV[1]  STEP: `arrive` (a delivery of the message begins), `reserved` (it reserved
--          RESERVATION), `start` (its call is about to start) or `revive` (an operator replays
--          it: it becomes the latest)
-- ARGV[2]  the message's ID (1 to 1024 bytes)
-- ARGV[3]  its VERSION: '' for none, else an integer of at most 15 digits, optionally signed
-- ARGV[4]  TTL in ms (integer >= 1)
-- ARGV[5]  SIGNATURE: what a reservation must match to be taken over (no newline; at most
--          300 bytes)
-- ARGV[6]  with `reserved`: the RESERVATION as it travels in a header (no newline; at most
--          4096 bytes)
-- Returns {VERDICT, BY, RESERVATION}
--   VERDICT 'go': the message proceeds; with `arrive`, RESERVATION (else '') is the reservation
--   of the message it superseded, now its own, and BY that message's id.
--   VERDICT 'superseded': BY is the latest's id; RESERVATION is 'taken' when this message's
--   reservation went to a newer message (it must not give it back), else ''.

local step = ARGV[1]
if step ~= 'arrive' and step ~= 'reserved' and step ~= 'start' and step ~= 'revive' then
  error({err = 'ERR turnstile: STEP must be arrive, reserved, start or revive'})
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
local signature = ARGV[5] or ''
if #signature > 300 or string.find(signature, '\n', 1, true) then
  error({err = 'ERR turnstile: SIGNATURE must be at most 300 bytes without a newline'})
end
local reservation = ARGV[6] or ''
if step == 'reserved' and (#reservation < 1 or #reservation > 4096
    or string.find(reservation, '\n', 1, true)) then
  error({err = 'ERR turnstile: RESERVATION must be 1 to 4096 bytes without a newline'})
end

local key = KEYS[1]
local function touched(answer)
  redis.call('PEXPIRE', key, ttl)
  return answer
end

local function superseded(by)
  local taken = ''
  if redis.call('HEXISTS', key, 'a:' .. id) == 1 then taken = 'taken' end
  return touched({'superseded', by or '', taken})
end

-- "SEQ" or "SEQ VERSION" as {seq, version or nil}.
local function order_of(seen)
  local seq, v = string.match(seen, '^(%d+) ?(%-?%d*)$')
  if seq == nil then return nil end
  if v == '' then v = nil end
  return {tonumber(seq), v and tonumber(v)}
end

-- Whether a message first seen as A is newer than one first seen as B.
local function newer(a, b)
  if a[2] ~= nil and b[2] ~= nil and a[2] ~= b[2] then return a[2] > b[2] end
  return a[1] > b[1]
end

local latest = redis.call('HGET', key, 'latest')
if latest == false then latest = nil end
local started = redis.call('HEXISTS', key, 'c:' .. id) == 1

if step == 'revive' then
  local seq = redis.call('HINCRBY', key, 'seq', 1)
  local seen = tostring(seq)
  if version ~= '' then seen = seen .. ' ' .. version end
  redis.call('HSET', key, 'm:' .. id, seen, 'latest', id)
  redis.call('HDEL', key, 'a:' .. id, 'r')
  return touched({'go', '', ''})
end

if step == 'start' then
  if started then return touched({'go', '', ''}) end
  if latest ~= nil and latest ~= id then return superseded(latest) end
  redis.call('HSET', key, 'c:' .. id, '1', 'latest', id)
  if redis.call('HEXISTS', key, 'm:' .. id) == 0 then
    local seq = redis.call('HINCRBY', key, 'seq', 1)
    local seen = tostring(seq)
    if version ~= '' then seen = seen .. ' ' .. version end
    redis.call('HSET', key, 'm:' .. id, seen)
  end
  redis.call('HDEL', key, 'r')
  return touched({'go', '', ''})
end

if step == 'reserved' then
  if started then return touched({'go', '', ''}) end
  if latest ~= id then return superseded(latest) end
  redis.call('HSET', key, 'r', id .. '\n' .. signature .. '\n' .. reservation)
  return touched({'go', '', ''})
end

-- arrive
if started then return touched({'go', '', ''}) end
local seen = redis.call('HGET', key, 'm:' .. id)
if seen ~= false then
  if latest == id or latest == nil then
    redis.call('HSET', key, 'latest', id)
    return touched({'go', '', ''})
  end
  return superseded(latest)
end
local seq = redis.call('HINCRBY', key, 'seq', 1)
local mine = tostring(seq)
if version ~= '' then mine = mine .. ' ' .. version end
redis.call('HSET', key, 'm:' .. id, mine)
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
local held = redis.call('HGET', key, 'r')
redis.call('HDEL', key, 'r')
if held ~= false then
  local holder, sig, encoded = string.match(held, '^([^\n]*)\n([^\n]*)\n(.*)$')
  if holder == latest and sig == signature and encoded ~= nil and encoded ~= '' then
    redis.call('HSET', key, 'a:' .. latest, '1')
    return touched({'go', latest, encoded})
  end
end
return touched({'go', latest, ''})

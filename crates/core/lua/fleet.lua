-- @include args
-- fleet: the replicas' registry. Each replica renews its entry every heartbeat (`beat`), takes
-- it out when it stops (`leave`); an entry not renewed within its EXPIRY is dropped by the next
-- call. Tools read it (`read`). Each replica also notes the algorithm it grants under, with
-- when it last did (KEYS[2]): grants under another algorithm wait until those have left every
-- window (see permit/applied.rs).
--
-- KEYS[1]  the fleet (hash: replica id -> "SINCE_MS LAST_MS EXPIRY_MS ENTRY"; at most
--          MAX_MEMBERS live entries; expires EXPIRY after the last call that renewed one)
-- KEYS[2]  the fleet's algorithms (hash: algorithm -> the last Redis ms a replica granted
--          under it, or stopped granting under it)
-- ARGV[1]  ACTION: `beat`, `leave` or `read`
-- ARGV[2]  with beat and leave: the replica's ID (1 to 200 bytes)
-- ARGV[3]  with beat: its ENTRY (JSON, at most 16 KiB; kept as given)
-- ARGV[4]  with beat: EXPIRY in ms (integer >= 1): the entry is dropped when not renewed that
--          long
-- ARGV[5]  with beat and leave: the ALGORITHM it grants under ('' for none yet)
-- ARGV[6]  with beat: RETAIN in ms (integer >= 1): KEYS[2] is kept at least that long
-- Returns {NOW_MS, MEMBERS, ALGORITHMS}: MEMBERS the live entries, each {ID, SINCE_MS,
--   LAST_MS, ENTRY} (SINCE_MS: its first beat); ALGORITHMS a flat list {ALGORITHM, LAST_MS, …}

local MAX_MEMBERS = 1000
local MAX_ENTRY = 16384

local action = ARGV[1]
if action ~= 'beat' and action ~= 'leave' and action ~= 'read' then
  error({err = 'ERR turnstile: ACTION must be beat, leave or read'})
end
local id = ARGV[2]
if action ~= 'read' and (id == nil or #id < 1 or #id > 200) then
  error({err = 'ERR turnstile: ID must be 1 to 200 bytes'})
end
local expiry, retain = 0, 0
if action == 'beat' then
  if ARGV[3] == nil or #ARGV[3] > MAX_ENTRY then
    error({err = 'ERR turnstile: ENTRY must be at most ' .. MAX_ENTRY .. ' bytes'})
  end
  expiry = int_arg(4, 1)
  retain = int_arg(6, 1)
end
local algorithm = ARGV[5] or ''
if action ~= 'read' and algorithm ~= '' then algorithm_arg(5) end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- The live entries (the expired ones dropped, unless only reading).
local members, live = {}, 0
local raw = redis.call('HGETALL', KEYS[1])
for i = 1, #raw, 2 do
  local since, last, ttl, entry = string.match(raw[i + 1], '^(%d+) (%d+) (%d+) (.*)$')
  since, last, ttl = tonumber(since), tonumber(last), tonumber(ttl)
  if since == nil or now > last + ttl then
    if action ~= 'read' then redis.call('HDEL', KEYS[1], raw[i]) end
  elseif raw[i] ~= id then
    live = live + 1
    members[#members + 1] = {raw[i], since, last, entry}
  end
end

if action == 'beat' then
  local held = redis.call('HGET', KEYS[1], id)
  local since = held and tonumber(string.match(held, '^(%d+) ')) or nil
  if since == nil and live >= MAX_MEMBERS then
    error({err = 'ERR turnstile: the fleet already has ' .. MAX_MEMBERS .. ' live replicas'})
  end
  since = since or now
  redis.call('HSET', KEYS[1], id, since .. ' ' .. now .. ' ' .. expiry .. ' ' .. ARGV[3])
  members[#members + 1] = {id, since, now, ARGV[3]}
  if redis.call('PTTL', KEYS[1]) < expiry then redis.call('PEXPIRE', KEYS[1], expiry) end
elseif action == 'leave' then
  redis.call('HDEL', KEYS[1], id)
end

if action ~= 'read' and algorithm ~= '' then
  redis.call('HSET', KEYS[2], algorithm, now)
end
if action == 'beat' and redis.call('PTTL', KEYS[2]) < retain then
  redis.call('PEXPIRE', KEYS[2], retain)
end
return {now, members, redis.call('HGETALL', KEYS[2])}

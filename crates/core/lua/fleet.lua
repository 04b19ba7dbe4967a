-- @include args
-- fleet: the replicas' registry. Each replica renews its entry every heartbeat (`beat`), takes
-- it out when it stops (`leave`); an entry not renewed within its EXPIRY is moved, by the next
-- call of any action, to the lost replicas (KEYS[3]), kept there LOST_RETAIN, unless its
-- replica beats again (live again: taken out) or leaves. Tools read it all (`read`). Each
-- replica also notes the algorithm it grants under, with when it last did (KEYS[2]): grants
-- under another algorithm wait until those have left every window (see permit/applied.rs).
--
-- KEYS[1]  the fleet (hash: replica id -> "SINCE_MS LAST_MS EXPIRY_MS ENTRY"; at most
--          MAX_MEMBERS live entries; expires EXPIRY + LOST_RETAIN after the last beat, so that
--          the entries of a fleet whose every replica stopped beating are still found lost)
-- KEYS[2]  the fleet's algorithms (hash: algorithm -> the last Redis ms a replica granted
--          under it, or stopped granting under it)
-- KEYS[3]  the fleet's lost replicas (hash: replica id -> "LOST_MS LAST_MS SINCE_MS ENTRY",
--          LOST_MS being when its entry expired, LAST_MS + its EXPIRY_MS; at most MAX_LOST, the
--          longest lost dropped first; each dropped LOST_RETAIN after LOST_MS; expires
--          LOST_RETAIN after the last entry moved in)
-- KEYS[4]  the replicas that left lately (hash: replica id -> LEFT_MS, when it left; at most
--          MAX_LEFT, all dropped beyond; expires LEFT_RETAIN after the last leave): a replica
--          that remembers another's terms forgets them at once when it left, and waits out
--          their expiry when its entry vanished otherwise (the key deleted, a failover)
-- ARGV[1]  ACTION: `beat`, `leave` or `read`
-- ARGV[2]  with beat and leave: the replica's ID (1 to 200 bytes)
-- ARGV[3]  with beat: its ENTRY (JSON, at most 16 KiB; kept as given)
-- ARGV[4]  with beat: EXPIRY in ms (integer >= 1): the entry is lost when not renewed that
--          long
-- ARGV[5]  with beat and leave: the ALGORITHM it grants under ('' for none yet)
-- ARGV[6]  with beat: RETAIN in ms (integer >= 1): KEYS[2] is kept at least that long
-- ARGV[7]  LOST_RETAIN in ms (integer >= 1): how long a lost replica stays listed
-- Returns {NOW_MS, MEMBERS, ALGORITHMS, LOST, LEFT}: MEMBERS the live entries, each {ID,
--   SINCE_MS, LAST_MS, ENTRY} (SINCE_MS: its first beat since it was last live); ALGORITHMS a
--   flat list {ALGORITHM, LAST_MS, …}; LOST the lost replicas, each {ID, LOST_MS, LAST_MS,
--   SINCE_MS, ENTRY} (ENTRY: its last); LEFT the ids of the replicas that left within
--   LEFT_RETAIN

local MAX_MEMBERS = 1000
local MAX_LOST = 1000
local MAX_ENTRY = 16384
local MAX_LEFT = 1000
local LEFT_RETAIN = 60000

local action = ARGV[1]
if action ~= 'beat' and action ~= 'leave' and action ~= 'read' then
  error({err = 'ERR turnstile: ACTION must be beat, leave or read'})
end
local id = ARGV[2]
if action ~= 'read' and (id == nil or #id < 1 or #id > 200) then
  error({err = 'ERR turnstile: ID must be 1 to 200 bytes'})
end
if action == 'read' then id = nil end
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
local lost_retain = int_arg(7, 1)

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- The live entries; the expired ones move to the lost (the caller's own is only dropped: it
-- beats again, or leaves).
local members, live, moved = {}, 0, false
local raw = redis.call('HGETALL', KEYS[1])
for i = 1, #raw, 2 do
  local since, last, ttl, entry = string.match(raw[i + 1], '^(%d+) (%d+) (%d+) (.*)$')
  since, last, ttl = tonumber(since), tonumber(last), tonumber(ttl)
  if since == nil or now > last + ttl then
    redis.call('HDEL', KEYS[1], raw[i])
    local lost = since and last + ttl
    if lost and raw[i] ~= id and now < lost + lost_retain then
      redis.call('HSET', KEYS[3], raw[i], lost .. ' ' .. last .. ' ' .. since .. ' ' .. entry)
      moved = true
    end
  elseif raw[i] ~= id then
    live = live + 1
    members[#members + 1] = {raw[i], since, last, entry}
  end
end
if moved and redis.call('PTTL', KEYS[3]) < lost_retain then
  redis.call('PEXPIRE', KEYS[3], lost_retain)
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
  if redis.call('PTTL', KEYS[1]) < expiry + lost_retain then
    redis.call('PEXPIRE', KEYS[1], expiry + lost_retain)
  end
  redis.call('HDEL', KEYS[4], id)
elseif action == 'leave' then
  redis.call('HDEL', KEYS[1], id)
  if redis.call('HLEN', KEYS[4]) >= MAX_LEFT then redis.call('DEL', KEYS[4]) end
  redis.call('HSET', KEYS[4], id, now)
  redis.call('PEXPIRE', KEYS[4], LEFT_RETAIN)
end

-- The lost replicas: the caller's own taken out (live again, or gone cleanly), those past
-- LOST_RETAIN dropped, then the longest lost beyond MAX_LOST.
if id then redis.call('HDEL', KEYS[3], id) end
local lost = {}
raw = redis.call('HGETALL', KEYS[3])
for i = 1, #raw, 2 do
  local lost_ms, last, since, entry = string.match(raw[i + 1], '^(%d+) (%d+) (%d+) (.*)$')
  lost_ms, last, since = tonumber(lost_ms), tonumber(last), tonumber(since)
  if lost_ms == nil or now >= lost_ms + lost_retain then
    redis.call('HDEL', KEYS[3], raw[i])
  else
    lost[#lost + 1] = {raw[i], lost_ms, last, since, entry}
  end
end
if #lost > MAX_LOST then
  table.sort(lost, function(a, b) return a[2] > b[2] or (a[2] == b[2] and a[1] < b[1]) end)
  for i = #lost, MAX_LOST + 1, -1 do
    redis.call('HDEL', KEYS[3], lost[i][1])
    lost[i] = nil
  end
end

if action ~= 'read' and algorithm ~= '' then
  redis.call('HSET', KEYS[2], algorithm, now)
end
if action == 'beat' and redis.call('PTTL', KEYS[2]) < retain then
  redis.call('PEXPIRE', KEYS[2], retain)
end
local left = {}
raw = redis.call('HGETALL', KEYS[4])
for i = 1, #raw, 2 do
  if now < (tonumber(raw[i + 1]) or 0) + LEFT_RETAIN then left[#left + 1] = raw[i] end
end
return {now, members, redis.call('HGETALL', KEYS[2]), lost, left}

-- @include args
-- @include calls
-- @include limits
-- @include losses
-- @include pauses
-- @include time
-- @include units
-- global: the global limit (TURNSTILE_GLOBAL_LIMIT), one stack for all sellers together, shared
-- fairly among the sellers with work. Asked once a seller's own permit granted a call now; the
-- call is made only if this grants too (else the seller's grant is given back: release.lua).
--
-- The limit: an exact sliding log of the units granted, every limit of the stack checked at
-- once. As a seller's calls do (calls_gate in include/calls.lua), each call holds its place in
-- the log from its grant until its answer, because the downstream may count it at any moment in
-- between: a unit's score is the call's END, its grant + BOUND while it is in flight, when its
-- answer came once global_end.lua records it. A call of COST units is granted only while, for
-- every limit, the units whose END lies within its WINDOW (+ GUARD) leave room for COST more;
-- so no window of the downstream holds more than COUNT units, whatever each call's latency
-- (docs/guarantees.md, "Exact whatever the latency"). Nothing is reserved ahead, so no seller
-- holds global slots ahead of another.
--
-- Fairness (start-time fair queuing over virtual time): a seller competes while it is being
-- refused: from a refusal until IDLE after the time its last refusal told it to come back (a
-- seller whose calls are all granted takes nothing from anyone and holds nothing back). Each competing seller S has a finish tag
-- F(S), in units per weight; the virtual time V is the smallest F of the competing sellers
-- (never going back). A seller that starts competing starts at max(F(S), V): no credit for
-- idleness, and a seller new to the contention is level with the least-served one. A call of
-- COST units may take global units only while its seller's start max(F(S), V) is at most
-- QUANTUM ahead of V; a competing seller's grant then moves F(S) on by COST / WEIGHT. So while
-- sellers compete, each one's served units per weight stay within QUANTUM (+ one call) of
-- every other's: shares follow the weights, and a seller with a deep backlog cannot take the
-- budget from one with three products. When a seller stops competing, V moves on to the
-- others within IDLE: the budget is never held for it.
--
-- A denial says when to come back: no sooner than the global log has room for COST, and at
-- the seller's next ticket: each seller's denied calls are spread at the global rate (one
-- ticket per COST / rate), the most the seller could be given if it were alone. A seller whose
-- share turns out smaller is denied again and comes back later; one that is left alone finds
-- its calls coming back as fast as the budget allows.
--
-- KEYS[1]  the global log (sorted set: member = `<unit>|<seller>`, see unit; score = the
--          call's END in µs)
-- KEYS[2]  the fair state (hash: `v` = virtual time, `w` = the competing sellers' weights)
-- KEYS[3]  the competing sellers' finish tags (sorted set: seller -> F)
-- KEYS[4]  the competing sellers (sorted set: seller -> competing until, µs: IDLE after its
--          last ticket)
-- KEYS[5]  the sellers' weights (hash: seller -> weight 1 to 1000; absent = 1; `limits set
--          --weight`)
-- KEYS[6]  the competing sellers' tickets and weights (hash: `t|<seller>` -> next ticket µs,
--          `w|<seller>` -> the weight it started competing with)
-- KEYS[7]  the global state's server stamp (see check_server in include/losses.lua)
-- KEYS[8]  the global pause (string: its end in µs), set by check_server
-- KEYS[9]  the loss marker of the global keys' hash slot (no TTL; see losses_since in
--          include/losses.lua)
-- ARGV[1]  COUNTS of the global stack, comma-separated (integers >= 1; 1 to 8 limits)
-- ARGV[2]  WINDOWS in µs, comma-separated, one per count
-- ARGV[3]  GUARD in µs added to each window (-1 = window/20 within [25 ms, 2 s])
-- ARGV[4]  TOKEN of the call (letters, digits, dashes; at most 64)
-- ARGV[5]  COST: units the call takes (integer from 1 to 10000)
-- ARGV[6]  SELLER: the seller's key tag (1 to 2048 characters, no `|`)
-- ARGV[7]  IDLE in µs (integer >= 1)
-- ARGV[8]  FLAGS: +2 = Redis keeps its data across restarts (no server check)
-- ARGV[9]  BOUND in µs: the latest a call granted now is answered (or times out); 0 = at its
--          grant
-- Returns {STATUS, AT_US, NOW_US, WHY}
--   STATUS 1 = granted (call now), 0 = denied (come back at AT), 4 = COST exceeds the smallest
--   COUNT of the stack: never granted (AT_US is that COUNT);
--   WHY 0 = granted, 1 = ahead of its fair share, 2 = the global limit has no room now.

local limits = with_spans(limits_arg(1), int_arg(3, -1))
local token = token_arg(4)
local cost = int_arg(5, 1)
if cost > MAX_COST then error({err = 'ERR turnstile: COST must be at most ' .. MAX_COST}) end
local seller = seller_arg(6)
local idle = int_arg(7, 1)
local durable = int_arg(8, 0) >= 2
local bound = int_arg(9, 0)
local now = now_us()
if cost > limits.min_count then return {4, limits.min_count, now, 0} end
check_server(KEYS[7], KEYS[1], KEYS[8], KEYS[9], limits.max_span, now, durable)

-- The global rate (units per µs) of the stack's slowest limit: the pace of a seller's tickets.
local rate = limits.slowest.count / limits.slowest.span
local quantum = math.max(limits.min_count / 20, 1)

-- Most a seller's weight may be (permit::admin::MAX_WEIGHT in Rust; src/permit/scripts.rs
-- checks that they are equal).
local MAX_WEIGHT = 1000

-- A weight as set (1 to MAX_WEIGHT), whatever the hash holds.
local function weight_of(raw)
  local w = math.floor(tonumber(raw or '1') or 1)
  return math.min(math.max(w, 1), MAX_WEIGHT)
end

-- Sellers that stopped competing leave (up to 256 per call; the rest at the next calls).
local gone = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, 256)
for _, s in ipairs(gone) do
  redis.call('HINCRBYFLOAT', KEYS[2], 'w', -weight_of(redis.call('HGET', KEYS[6], 'w|' .. s)))
  redis.call('ZREM', KEYS[4], s)
  redis.call('ZREM', KEYS[3], s)
  redis.call('HDEL', KEYS[6], 'w|' .. s, 't|' .. s)
end
if redis.call('ZCARD', KEYS[4]) == 0 then redis.call('HSET', KEYS[2], 'w', 0) end

local competing = redis.call('ZSCORE', KEYS[4], seller) ~= false
local weight = weight_of(redis.call('HGET', KEYS[5], seller))
if competing then weight = weight_of(redis.call('HGET', KEYS[6], 'w|' .. seller)) end

local v = tonumber(redis.call('HGET', KEYS[2], 'v') or '0') or 0
local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
if first[2] ~= nil then v = math.max(v, tonumber(first[2])) end
local start = math.max(tonumber(redis.call('ZSCORE', KEYS[3], seller) or '') or v, v)
redis.call('HSET', KEYS[2], 'v', string.format('%.17g', v))

-- Every fair key lives as long as a seller may still compete.
local function keep_fair()
  local last = tonumber(redis.call('ZRANGE', KEYS[4], -1, -1, 'WITHSCORES')[2] or '') or now
  local ttl = math.floor((math.max(last - now, 0) + idle + limits.max_span) / 1000) + 1
  for _, key in ipairs({KEYS[2], KEYS[3], KEYS[4], KEYS[6]}) do redis.call('PEXPIRE', key, ttl) end
end

-- Room now: for every limit, the units whose END lies in its span leave room for COST more;
-- and no pause (a Redis that may have lost grants, see check_server). Without room, the log
-- opens when enough ENDs leave every span: exactly then when the END that decides is an answer
-- already recorded; while that call is still in flight, no later than GUARD (at least 25 ms)
-- from now, as its answer usually comes much sooner than its BOUND.
local room_at = calls_gate(KEYS[1], now, limits, cost, 'span')
local pause = paused_until(KEYS[8])
if pause > now then room_at = math.max(room_at or 0, pause) end

local ahead = start - v > quantum
if not ahead and room_at == nil then
  local args = {}
  for i = 1, cost do
    args[#args + 1] = now + bound
    args[#args + 1] = unit(token, i) .. '|' .. seller
    if #args >= 1000 or i == cost then
      redis.call('ZADD', KEYS[1], unpack(args))
      args = {}
    end
  end
  keep_calls(KEYS[1], bound + limits.max_span)
  keep_stamp(KEYS[7], redis.call('PTTL', KEYS[1]), durable)
  if competing then
    redis.call('ZADD', KEYS[3], string.format('%.17g', start + cost / weight), seller)
    keep_fair()
  end
  return {1, now, now, 0}
end

-- Refused: the seller comes back at its next ticket, not before there is room, and competes
-- until IDLE after that (it still has work).
if not competing then
  redis.call('HINCRBYFLOAT', KEYS[2], 'w', weight)
  redis.call('HSET', KEYS[6], 'w|' .. seller, weight)
end
redis.call('ZADD', KEYS[3], string.format('%.17g', start), seller)
local interval = cost / rate
local at = math.max(room_at or 0, now + interval)
at = math.max(at, tonumber(redis.call('HGET', KEYS[6], 't|' .. seller) or '0') or 0)
redis.call('HSET', KEYS[6], 't|' .. seller, string.format('%.0f', at + interval))
redis.call('ZADD', KEYS[4], 'GT', at + idle, seller)
keep_fair()
local why = 2
if ahead then why = 1 end
return {0, math.floor(at), now, why}

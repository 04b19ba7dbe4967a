-- token_bucket: refill RATE = COUNT per WINDOW+GUARD into a bucket of CAPACITY tokens, each call
-- takes REQUESTED tokens (as in Spring Cloud Gateway's script). Reserving lets the bucket go
-- into debt, which schedules callers one after another instead of denying them in a loop.
-- Not exact over a sliding window: a full bucket plus its refill allows up to
-- CAPACITY + COUNT grants within one window.
--
-- KEYS[1]  the seller's bucket (hash: tokens, ts = µs at which `tokens` holds)
-- KEYS[2]  the seller's limit override ("COUNT WINDOW_US"), may be absent
-- KEYS[3]  the seller's pause ("UNTIL_US"), may be absent
-- KEYS[4]  the seller's reserved slots (sorted set: member = TOKEN, score = slot; see the prelude)
-- KEYS[5]  the seller's server stamp (run id of the Redis that wrote its state; see the prelude)
-- KEYS[6]  the seller's calls (unused: this algorithm is not exact, see README)
-- KEYS[7]  the seller's far queue (hash: at, n; see far_ticket in the prelude)
-- KEYS[8]  optional: the message's completion record; if it exists nothing is written
-- ARGV[1]  default COUNT (integer >= 1)
-- ARGV[2]  default WINDOW in µs (integer >= 1)
-- ARGV[3]  GUARD in µs added to the window (-1 = window/20 within [25 ms, 2 s])
-- ARGV[4]  FLAGS: +1 = reserve a future slot for a caller who must wait (else only answer);
--          +2 = Redis keeps its data across restarts (no cold-start wait, see the prelude)
-- ARGV[5]  HORIZON in µs: a slot further away than this is never reserved
-- ARGV[6]  TOKEN: a string unique to this attempt (letters, digits, dashes; at most 64)
-- ARGV[7]  BOUND (unused: calls are not tracked)
-- ARGV[8]  CAPACITY (integer >= 0; 0 = COUNT)
-- ARGV[9]  REQUESTED tokens (integer >= 1, at most the capacity)
-- Returns {STATUS, SLOT_US, NOW_US, COUNT, WINDOW_US, USED_PERMILLE}
--   STATUS 1 = granted (call now), 2 = reserved (call at SLOT), 0 = denied (come back at SLOT;
--   with reserving on, when the seller's reserved set is full: see far_ticket),
--   3 = the message already registered (KEYS[8] says so);
--   USED_PERMILLE (with STATUS 1) is how much of the limit is taken after
--   this grant, in thousandths (tokens taken / CAPACITY): the near-limit metric;

local a = acquire_args()
local capacity = int_arg(8, 0)
local requested = int_arg(9, 1)
local count, window = effective_limit(KEYS[2], a.count, a.window)
if capacity == 0 then capacity = count end
if requested > capacity then error({err = 'ERR turnstile: REQUESTED exceeds CAPACITY'}) end
local guard = guard_for(window, a.guard)
local rate = count / (window + guard) -- tokens per µs
local now = now_us()
if already_done(KEYS[8]) then return {3, now, now, count, window} end
check_server(KEYS[5], KEYS[1], KEYS[3], window + guard, now, a.durable)

local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or capacity
local ts = tonumber(state[2]) or now
local at = math.max(now, paused_until(KEYS[3]))
-- Tokens at `at`: refill since ts (before ts the debt is larger still), capped at capacity.
local filled = math.min(tokens + (at - ts) * rate, capacity)
local slot = at
if filled < requested then slot = math.ceil(at + (requested - filled) / rate) end

local status = due(slot, now, guard, a)
local late = lateness('token-bucket', window, guard)
status, slot = slot_or_far_ticket(status, slot, KEYS[4], KEYS[7], now, late, window + guard, count)
if status == 0 then return {0, slot, now, count, window} end
local left = filled + (slot - at) * rate - requested
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', left), 'ts', string.format('%.0f', slot))
local full_at = slot + (capacity - left) / rate -- idle from then on: the key may go
local ttl = math.floor((full_at - now) / 1000) + 1
redis.call('PEXPIRE', KEYS[1], ttl)
if keep_and_hold(status, ttl, KEYS[5], KEYS[4], slot, now, late, a) then
  return {2, slot, now, count, window}
end
return {status, slot, now, count, window, math.floor((capacity - left) * 1000 / capacity)}

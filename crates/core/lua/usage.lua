-- usage: how much of a seller's limit is taken now, for the dashboard. Reads only; never writes.
-- USED of CAPACITY is what the limit counts now (the share that makes the next caller wait);
-- AHEAD is what is already promised beyond it (reserved slots, debt): the scheduled backlog.
--   sliding-window: USED = grants in the trailing window (+ guard), CAPACITY = COUNT,
--                   AHEAD = slots reserved after now
--   gcra:           cells = ceil((TAT - now) / interval); USED = min(cells, BURST),
--                   CAPACITY = BURST, AHEAD = the other cells
--   token-bucket:   USED = tokens taken (CAPACITY - tokens now), AHEAD = debt in tokens
--   fixed-window:   USED = slots of the current window, CAPACITY = COUNT,
--                   AHEAD = slots reserved in later windows
--
-- KEYS[1]  the seller's limiter state for ALGORITHM (see the acquire scripts)
-- KEYS[2]  the seller's limit override ("COUNT WINDOW_US"), may be absent
-- KEYS[3]  the seller's pause ("UNTIL_US"), may be absent
-- ARGV[1]  ALGORITHM: sliding-window, gcra, token-bucket or fixed-window
-- ARGV[2]  default COUNT (integer >= 1)
-- ARGV[3]  default WINDOW in µs (integer >= 1)
-- ARGV[4]  GUARD in µs (-1 = window/20 within [25 ms, 2 s])
-- ARGV[5]  gcra: BURST (integer >= 1); others: ignored
-- ARGV[6]  token-bucket: CAPACITY (integer >= 0; 0 = COUNT); others: ignored
-- Returns {USED, CAPACITY, AHEAD, COUNT, WINDOW_US, PAUSED_UNTIL_US, NOW_US, OVERRIDE}
--   COUNT and WINDOW_US are the limit that applies; OVERRIDE is 1 when it is the seller's own.

local algorithm = ARGV[1]
local count, window = effective_limit(KEYS[2], int_arg(2, 1), int_arg(3, 1))
local guard = guard_for(window, int_arg(4, -1))
local span = window + guard
local now = now_us()
local used, capacity, ahead = 0, count, 0

if algorithm == 'sliding-window' then
  used = redis.call('ZCOUNT', KEYS[1], string.format('(%.0f', now - span), string.format('%.0f', now))
  ahead = redis.call('ZCOUNT', KEYS[1], string.format('(%.0f', now), '+inf')
elseif algorithm == 'gcra' then
  local burst = math.min(int_arg(5, 1), count)
  local interval = span / (count - burst + 1)
  local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
  local cells = math.ceil(math.max(tat - now, 0) / interval)
  capacity = burst
  used = math.min(cells, burst)
  ahead = cells - used
elseif algorithm == 'token-bucket' then
  capacity = int_arg(6, 0)
  if capacity == 0 then capacity = count end
  local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local tokens = tonumber(state[1]) or capacity
  local ts = tonumber(state[2]) or now
  -- Tokens now: refilled since ts, or (ts in the future, a reservation) the debt still to pay.
  local tokens_now = math.min(tokens + (now - ts) * count / span, capacity)
  used = math.ceil(capacity - math.max(tokens_now, 0))
  ahead = math.ceil(math.max(-tokens_now, 0))
elseif algorithm == 'fixed-window' then
  local current = math.floor(now / window)
  local fields = redis.call('HGETALL', KEYS[1])
  for i = 1, #fields, 2 do
    local w = tonumber(fields[i])
    if fields[i] ~= 'next' and w then
      if w == current then used = tonumber(fields[i + 1])
      elseif w > current then ahead = ahead + tonumber(fields[i + 1]) end
    end
  end
else
  error({err = 'ERR turnstile: unknown ALGORITHM ' .. tostring(algorithm)})
end

return {used, capacity, ahead, count, window, paused_until(KEYS[3]), now, redis.call('EXISTS', KEYS[2])}

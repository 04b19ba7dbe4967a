-- block_end: writes what a permit block's calls answered once the block is over (see
-- take_block in the prelude and src/permit/block.rs), in one step instead of one per call (the
-- call that took the block, TOKEN, is its unit 1):
--   * each answered unit's END in the seller's calls comes forward to when its answer came
--     (never back; see end_call), so it stops holding its place in the window beyond then;
--   * with ADAPTIVE, the accepted ones go into the seller's accepted log (see note_accepted);
--   * the units never called (not handed out, or given back unused) leave the log, the calls and
--     the unclaimed units: the next call may take them.
-- A unit not named here keeps its place until its END (the latest its call could answer).
--
-- KEYS[1]  the seller's log (sliding-window)
-- KEYS[2]  the seller's calls
-- KEYS[3]  the seller's unclaimed block units (see take_block)
-- KEYS[4]  with ADAPTIVE: the seller's accepted log
-- KEYS[5]  with ADAPTIVE: the seller's limit override, may be absent
-- ARGV[1]  TOKEN of the call that took the block (letters, digits, dashes; at most 64)
-- ARGV[2]  N: how many units are given back (0 to MAX_BLOCK)
-- ARGV[3]  M: how many answers follow (0 to MAX_BLOCK + 1)
-- then N unit numbers I (integers 2 to MAX_BLOCK + 1; unit I is block_unit(TOKEN, I))
-- then M triples: I (1 to MAX_BLOCK + 1; unit 1 is the call TOKEN itself), ANSWERED_US (when
--          its answer came, see answered_arg: -1 = now), ACCEPTED
--          (1 = the downstream accepted it, else 0)
-- then, only with ADAPTIVE: 1, default COUNTS, default WINDOWS in µs, GUARD in µs (-1 =
--          window/20 within [25 ms, 2 s])
-- Returns how many units were given back

local token = token_arg(1)
local n, m = int_arg(2, 0), int_arg(3, 0)
if n > MAX_BLOCK or m > MAX_BLOCK + 1 then
  error({err = 'ERR turnstile: N and M must be at most ' .. MAX_BLOCK .. ' and ' .. (MAX_BLOCK + 1)})
end
local now = now_us()
local function unit_arg(i, min)
  local u = int_arg(i, min)
  if u > MAX_BLOCK + 1 then
    error({err = 'ERR turnstile: a unit number is at most ' .. (MAX_BLOCK + 1)})
  end
  return block_unit(token, u)
end
local unused = {}
for i = 4, 3 + n do unused[#unused + 1] = unit_arg(i, 2) end
local ends, accepted = {}, {}
for j = 0, m - 1 do
  local at = 4 + n + 3 * j
  local unit = unit_arg(at, 1)
  local answered = string.format('%.0f', answered_arg(at + 1, now))
  ends[#ends + 1] = answered
  ends[#ends + 1] = unit
  if int_arg(at + 2, 0) == 1 then
    accepted[#accepted + 1] = answered
    accepted[#accepted + 1] = unit
  end
end
local rest = 4 + n + 3 * m
local adaptive = ARGV[rest] == '1'
local configured = nil
if #KEYS < 3 or (adaptive and #KEYS < 5) then
  error({err = 'ERR turnstile: block_end needs KEYS[1..3], and KEYS[4..5] with ADAPTIVE'})
end
if adaptive then
  if #ARGV ~= rest + 3 then error({err = 'ERR turnstile: the arguments do not match N and M'}) end
  configured = with_spans(effective_limits(KEYS[5], limits_arg(rest + 1)), int_arg(rest + 3, -1))
elseif #ARGV ~= rest - 1 then
  error({err = 'ERR turnstile: the arguments do not match N and M'})
end

if #unused > 0 then
  redis.call('ZREM', KEYS[3], unpack(unused))
  redis.call('ZREM', KEYS[2], unpack(unused))
  redis.call('ZREM', KEYS[1], unpack(unused))
end
if #ends > 0 then redis.call('ZADD', KEYS[2], 'XX', 'LT', unpack(ends)) end
if adaptive and #accepted > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - configured.max_span)
  redis.call('ZADD', KEYS[4], unpack(accepted))
  redis.call('ZREMRANGEBYRANK', KEYS[4], 0, -(2 * configured.max_count + #accepted / 2 + 1))
  redis.call('PEXPIRE', KEYS[4], math.floor(configured.max_span / 1000) + 1)
end
return #unused

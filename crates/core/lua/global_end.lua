-- @include args
-- @include time
-- @include units
-- global_end: a call that global.lua granted ended. Answered (or timed out, or failed), its
-- units' END in the global log comes forward to when its answer came (never back), so that
-- they hold their place only until then (see global.lua). Never sent, its units leave the log:
-- the downstream never counted them.
--
-- KEYS[1]  the global log (sorted set: member = `<unit>|<seller>`, score = the call's END)
-- ARGV[1]  TOKEN of the call (letters, digits, dashes; at most 64)
-- ARGV[2]  COST: the units it took (integer from 1 to MAX_COST)
-- ARGV[3]  SELLER: the seller's key tag, as global.lua was given it (1 to 2048 characters,
--          no `|`)
-- ARGV[4]  ANSWERED_US: when its answer came (see answered_arg in include/args.lua: -1 = now);
--          -2 = the call was never sent
-- Returns the number of units changed

local token = token_arg(1)
local cost = int_arg(2, 1)
if cost > MAX_COST then error({err = 'ERR turnstile: COST must be at most ' .. MAX_COST}) end
local seller = seller_arg(3)
local unsent = ARGV[4] == '-2'
local at = 0
if not unsent then at = answered_arg(4, now_us()) end

local changed = 0
local args = {}
local function flush()
  if #args == 0 then return end
  if unsent then
    changed = changed + redis.call('ZREM', KEYS[1], unpack(args))
  else
    changed = changed + redis.call('ZADD', KEYS[1], 'XX', 'LT', 'CH', unpack(args))
  end
  args = {}
end
for i = 1, cost do
  if not unsent then args[#args + 1] = at end
  args[#args + 1] = unit(token, i) .. '|' .. seller
  if #args >= 1000 then flush() end
end
flush()
return changed

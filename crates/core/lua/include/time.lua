-- time: the clock every limit is measured on. Reads only Redis's TIME.
-- Defines: now_us
-- Needs no other piece.

-- Redis server time in µs: the only clock a limit is measured on.
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

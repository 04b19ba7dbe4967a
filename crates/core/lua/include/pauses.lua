-- pauses: a seller's pause (string PAUSE_KEY: its end in µs, Redis time), read and extended.
-- Defines: paused_until, extend_pause
-- Needs no other piece.

-- The seller's pause end in µs (0 when not paused).
local function paused_until(pause_key)
  return tonumber(redis.call('GET', pause_key) or '0')
end

-- Pauses the seller (PAUSE_KEY) until UNTIL_US, unless it is paused longer already: a pause only
-- extends. Returns the pause's end.
local function extend_pause(pause_key, until_us, now)
  local current = paused_until(pause_key)
  if current >= until_us then return current end
  redis.call('SET', pause_key, string.format('%.0f', until_us), 'PX', math.floor((until_us - now) / 1000) + 1)
  return until_us
end

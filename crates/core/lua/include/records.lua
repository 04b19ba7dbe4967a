-- records: a message's completion record (string: `registered` or `dead:<REASON>`; written by
-- complete.lua), as the scripts that grant calls read it. Reads only.
-- Defines: already_done
-- Needs no other piece.

-- Whether the message already registered: its completion record (KEYS[n] if passed) says
-- `registered`. A dead letter's record (`dead:<REASON>`) is not done: a replayed or duplicate
-- copy is called again (see complete.lua).
local function already_done(key)
  if key == nil then return false end
  return redis.call('GET', key) == 'registered'
end

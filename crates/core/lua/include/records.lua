-- records: a message's completion record (string: `registered`, `registered <RESULT>` or
-- `dead:<REASON>`; written by complete.lua), as the scripts that grant calls read it. Reads
-- only. `registered <RESULT>`: registered, its result (JSON) not yet published; the replica
-- that publishes it (the one that registered it, or one that gets a redelivered copy) trims
-- the record to `registered`.
-- Defines: is_registered, already_done
-- Needs no other piece.

-- Whether a record's STATE (a string, or false/nil when there is none) says registered.
local function is_registered(state)
  return state == 'registered' or (type(state) == 'string' and string.sub(state, 1, 11) == 'registered ')
end

-- Whether the message already registered: its completion record (KEYS[n] if passed) says
-- `registered`. A dead letter's record (`dead:<REASON>`) is not done: a replayed or duplicate
-- copy is called again (see complete.lua).
local function already_done(key)
  if key == nil then return false end
  return is_registered(redis.call('GET', key))
end

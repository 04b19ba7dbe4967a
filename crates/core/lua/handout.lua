-- handout: whether a unit of a permit block (see take_block in the prelude) may be handed out
-- for a message's call: a unit, unlike an acquire, reads neither the message's completion
-- record nor the seller's pause by itself. Writes nothing.
--
-- KEYS[1]  the seller's pause ("UNTIL_US"), may be absent
-- KEYS[2]  optional: the message's completion record (see already_done and complete.lua)
-- Returns 0 = hand it out; 1 = the message already registered (no call); 2 = the seller is
--   paused (no call; the replica drops the block and acquires, which says when to come back)

if already_done(KEYS[2]) then return 1 end
if paused_until(KEYS[1]) > now_us() then return 2 end
return 0

-- @include args
-- @include calls
-- @include time
-- ended: records that a granted call was answered (or timed out, or failed), so that it no
-- longer holds its place in the seller's window beyond its answer (see calls_gate in
-- include/calls.lua). A registration records its answer in complete.lua instead.
--
-- KEYS[1]  the seller's calls (sorted set: member = TOKEN, score = END)
-- ARGV[1]  TOKEN of the call (letters, digits, dashes; at most 64)
-- ARGV[2]  ANSWERED_US: when its answer came (see answered_arg in include/args.lua; -1 or absent =
--          now)
-- ARGV[3]  COST of the call (integer from 1 to MAX_COST; 0 or absent = not known)
-- Returns 1

local token = token_arg(1)
local cost = 0
if ARGV[3] ~= nil then cost = int_arg(3, 0) end
if cost > MAX_COST then error({err = 'ERR turnstile: COST must be at most ' .. MAX_COST}) end
end_call(KEYS[1], token, answered_arg(2, now_us()), cost)
return 1

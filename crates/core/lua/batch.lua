-- @include args
-- batch: several operations in one call, run one after another, each exactly as its own script
-- would run it alone (with its own KEYS and ARGV; see `local KEYS, ARGV` in include/args.lua). A
-- replica sends what its workers ask for at the same moment, and the completion records that
-- wait to ride along, in one call instead of one each (see src/permit/batch.rs).
-- The operations, by NAME (each is its own file, wrapped in a function by src/permit/scripts.rs):
--   sliding-window, gcra, token-bucket, fixed-window   acquire (see sliding_window.lua)
--   redeem, complete, ended, learn                     see redeem.lua, complete.lua, ended.lua,
--                                                      learn.lua
-- On Redis Cluster every key of a batch must hash to one slot: a replica batches only the
-- operations of one seller there.
--
-- KEYS     every operation's keys, in order: the first NKEYS are the first operation's, ...
-- ARGV[1]  N: how many operations (1 to 256)
-- then for each operation in order: NAME, NKEYS, NARGS (integers >= 0), then its NARGS arguments
-- Returns one entry per operation, in order: {1, ANSWER} with the operation's own answer, or
--   {0, ERROR} when it raised ERROR (an operation checks its inputs before it writes anything,
--   so a refused one wrote nothing); one operation's error does not stop the others.
-- The layout is checked whole before any operation runs: a malformed batch runs nothing.

-- Most operations in one batch (permit::batch::MOST_PER_CALL in Rust is at most this).
local MOST_OPERATIONS = 256

local OPERATIONS = {
  ['sliding-window'] = op_sliding_window,
  ['gcra'] = op_gcra,
  ['token-bucket'] = op_token_bucket,
  ['fixed-window'] = op_fixed_window,
  ['redeem'] = op_redeem,
  ['complete'] = op_complete,
  ['ended'] = op_ended,
  ['learn'] = op_learn,
}

local all_keys, all_args = KEYS, ARGV
local function malformed(why)
  error({err = 'ERR turnstile: malformed batch: ' .. why})
end

local n = tonumber(all_args[1])
if n == nil or n ~= math.floor(n) or n < 1 or n > MOST_OPERATIONS then
  malformed('N must be 1 to ' .. MOST_OPERATIONS)
end
local plan = {}
local k, a = 1, 2
for i = 1, n do
  local name, nkeys, nargs = all_args[a], tonumber(all_args[a + 1]), tonumber(all_args[a + 2])
  if OPERATIONS[name] == nil then malformed('operation ' .. i .. ' has no known NAME') end
  if nkeys == nil or nkeys ~= math.floor(nkeys) or nkeys < 0
    or nargs == nil or nargs ~= math.floor(nargs) or nargs < 0 then
    malformed('operation ' .. i .. ' needs whole NKEYS and NARGS')
  end
  plan[i] = {name, k, k + nkeys - 1, a + 3, a + 2 + nargs}
  k, a = k + nkeys, a + 3 + nargs
end
if k ~= #all_keys + 1 or a ~= #all_args + 1 then
  malformed('the operations name ' .. (k - 1) .. ' keys and ' .. (a - 1) .. ' arguments, not '
    .. #all_keys .. ' and ' .. #all_args)
end

local answers = {}
for i, p in ipairs(plan) do
  KEYS = {unpack(all_keys, p[2], p[3])}
  ARGV = {unpack(all_args, p[4], p[5])}
  local ok, answer = pcall(OPERATIONS[p[1]])
  if ok then
    answers[i] = {1, answer}
  elseif type(answer) == 'table' then
    answers[i] = {0, tostring(answer.err or answer.message or 'ERR turnstile: operation failed')}
  else
    answers[i] = {0, tostring(answer)}
  end
end
return answers

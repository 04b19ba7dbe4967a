-- args: the call's KEYS and ARGV, and the checks of its arguments. Reads and writes nothing.
-- Defines: KEYS, ARGV, int_arg, token_arg, seller_arg, algorithm_arg, answered_arg, MAX_COST
-- Needs no other piece. Every piece whose helpers read KEYS or ARGV includes it, so that they
-- read these locals.

-- The call's keys and arguments, as locals every helper and script below reads: batch.lua runs
-- several operations in one call by giving each its own before it runs.
local KEYS, ARGV = KEYS, ARGV

-- ARGV[i] as an integer >= min, or the script fails before anything is written.
local function int_arg(i, min)
  local v = tonumber(ARGV[i])
  if v == nil or v ~= math.floor(v) or v < min then
    error({err = 'ERR turnstile: ARGV[' .. i .. '] must be an integer >= ' .. min})
  end
  return v
end

-- ARGV[i] as a reservation TOKEN (1 to 64 letters, digits or dashes), or the script fails
-- before anything is written.
local function token_arg(i)
  local token = ARGV[i]
  if token == nil or not string.match(token, '^[%w-]+$') or #token > 64 then
    error({err = 'ERR turnstile: TOKEN must be 1 to 64 letters, digits or dashes'})
  end
  return token
end

-- ARGV[i] as a seller's key tag in the global log's members (`<unit>|<seller>`: 1 to 2048
-- characters without `|`), or the script fails before anything is written.
local function seller_arg(i)
  local seller = ARGV[i]
  if seller == nil or #seller < 1 or #seller > 2048 or string.find(seller, '|', 1, true) then
    error({err = 'ERR turnstile: SELLER must be 1 to 2048 characters without |'})
  end
  return seller
end

-- ARGV[i] as one of the algorithms, or the script fails before anything is written.
local function algorithm_arg(i)
  local a = ARGV[i]
  if a ~= 'sliding-window' and a ~= 'gcra' and a ~= 'token-bucket' and a ~= 'fixed-window' then
    error({err = 'ERR turnstile: ARGV[' .. i .. '] must be an algorithm'})
  end
  return a
end

-- ARGV[i] as when a call's answer came back (ANSWERED_US, Redis time in µs, at most NOW): the
-- caller's upper bound for it (the grant's Redis time plus the time it measured from asking
-- for the permit to the answer), so that a record written later still ends the call when its
-- answer came; -1 or absent: NOW.
local function answered_arg(i, now)
  if ARGV[i] == nil or ARGV[i] == '-1' then return now end
  return math.min(int_arg(i, 0), now)
end

-- Most units one call may take (COST): a larger cost is refused before anything is written
-- (domain::Cost::MAX in Rust; src/permit/scripts.rs checks that they are equal).
local MAX_COST = 10000

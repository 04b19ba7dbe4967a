-- units: a call or slot of COST units as members of a sorted set, one per unit (the sliding
-- log, the calls, the accepted and shadow logs).
-- Defines: unit, for_units, add_units, remove_units
-- Needs no other piece.

-- The members of a sorted set that stand for the COST units of a call or slot TOKEN: TOKEN
-- itself, then TOKEN*2 up to TOKEN*COST (a token is letters, digits and dashes only).
local function unit(token, i)
  if i == 1 then return token end
  return token .. '*' .. i
end

-- Runs COMMAND on the sorted set KEY with the COST units of TOKEN (each after SCORE, if given;
-- from its FIRST unit, 1 if not given), in variadic calls of at most 500 units: ZADD adds them,
-- ZREM removes them.
local function for_units(command, key, token, cost, score, first)
  local args = {}
  for i = first or 1, cost do
    if score ~= nil then args[#args + 1] = score end
    args[#args + 1] = unit(token, i)
    if #args >= 1000 then
      redis.call(command, key, unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call(command, key, unpack(args)) end
end

-- Adds the COST units of TOKEN to the sorted set KEY at SCORE.
local function add_units(key, score, token, cost)
  for_units('ZADD', key, token, cost, score)
end

-- Removes the COST units of TOKEN from the sorted set KEY.
local function remove_units(key, token, cost)
  for_units('ZREM', key, token, cost)
end

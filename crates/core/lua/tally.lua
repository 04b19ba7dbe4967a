-- tally: adds BY to one count of a hash of counts (the dead letters now, by reason), never
-- taking it below zero: a decrement whose increment was lost (Redis unreachable just then) is
-- dropped instead of hiding a later dead letter. A count that reaches zero is removed, so a
-- decrement never creates a field.
--
-- KEYS[1]  the hash of counts
-- ARGV[1]  FIELD (1 to 64 letters, digits or dashes)
-- ARGV[2]  BY (integer, may be negative)
-- Returns the count now

local field = ARGV[1]
if field == nil or not string.match(field, '^[%w-]+$') or #field > 64 then
  error({err = 'ERR turnstile: FIELD must be 1 to 64 letters, digits or dashes'})
end
local by = tonumber(ARGV[2])
if by == nil or by ~= math.floor(by) then
  error({err = 'ERR turnstile: BY must be an integer'})
end
local n = math.max(tonumber(redis.call('HGET', KEYS[1], field) or '0') + by, 0)
if n == 0 then
  redis.call('HDEL', KEYS[1], field)
else
  redis.call('HSET', KEYS[1], field, n)
end
return n

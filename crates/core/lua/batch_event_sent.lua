-- batch_event_sent: a batch's completion event was published (confirmed): it is no longer
-- pending, unless the batch opened and completed again since (another EVENT is pending then).
--
-- KEYS[1]  the batch's progress (hash, see complete.lua)
-- ARGV[1]  EVENT: the event published (its `completed_ms`, as batch_event returned it)
-- Returns 1 when the event was pending and is no longer, else 0

local event = ARGV[1]
if event == nil or not string.match(event, '^%d+$') then
  error({err = 'ERR turnstile: EVENT must be a whole number'})
end
if redis.call('HGET', KEYS[1], 'event') ~= event then return 0 end
redis.call('HDEL', KEYS[1], 'event')
return 1

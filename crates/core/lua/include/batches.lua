-- @include args
-- @include time
-- batches: a batch's progress (hash, see complete.lua): its description, and its completion
-- event.
-- Defines: batch_args, describe_batch, batch_event, event_on_count

-- ARGV[i], ARGV[i+1], ARGV[i+2] as a batch: SELLER (the seller's id, 1 to 512 bytes), BATCH
-- (the batch's id, 1 to 1024 bytes) and SIZE (the message's batch_size, 0 to 1000000; 0 =
-- none), or the script fails before anything is written.
local function batch_args(i)
  local seller, id = ARGV[i], ARGV[i + 1]
  if seller == nil or #seller < 1 or #seller > 512 then
    error({err = 'ERR turnstile: SELLER must be 1 to 512 bytes'})
  end
  if id == nil or #id < 1 or #id > 1024 then
    error({err = 'ERR turnstile: BATCH must be 1 to 1024 bytes'})
  end
  local size = int_arg(i + 2, 0)
  if size > 1000000 then error({err = 'ERR turnstile: BATCH_SIZE must be at most 1000000'}) end
  return {seller = seller, id = id, size = size}
end

-- Writes what a batch's progress (hash KEY) says of itself, once: its seller and id, when it was
-- first seen (`first_ms`), and its total (the first SIZE given); a later message giving another
-- size is noted in `other_size` (the total stays).
local function describe_batch(key, batch)
  redis.call('HSETNX', key, 'seller', batch.seller)
  redis.call('HSETNX', key, 'batch', batch.id)
  redis.call('HSETNX', key, 'first_ms', math.floor(now_us() / 1000))
  if batch.size > 0 and redis.call('HSETNX', key, 'total', batch.size) == 0
    and tonumber(redis.call('HGET', key, 'total')) ~= batch.size then
    redis.call('HSET', key, 'other_size', batch.size)
  end
end

-- The pending completion event of the batch whose progress is KEY (its `completed_ms`), or ''.
-- A batch with a total whose registered + dead reach it completes now (`completed_ms` and
-- `event` set, once); one taken below it again (a replay) is open again (both removed).
local function batch_event(key)
  if key == nil then return '' end
  local f = redis.call('HMGET', key, 'total', 'registered', 'dead', 'completed_ms', 'event')
  local total = tonumber(f[1])
  if total == nil then return '' end
  local done = (tonumber(f[2]) or 0) + (tonumber(f[3]) or 0)
  if done >= total and not f[4] then
    local ms = string.format('%.0f', math.floor(now_us() / 1000))
    redis.call('HSET', key, 'completed_ms', ms, 'event', ms)
    return ms
  elseif done < total and f[4] then
    redis.call('HDEL', key, 'completed_ms', 'event')
    return ''
  end
  return f[5] or ''
end

-- The completion event for a message counted now in the batch whose progress is KEY: the
-- event if counting it completed the batch (see batch_event), else ''. A message counted after
-- its batch completed (one more than its total) leaves the event to the message that completed
-- it, which is not acked before the event is published (its redelivery publishes it if it
-- could not): two messages never race to publish it.
local function event_on_count(key)
  if key == nil then return '' end
  local completed_before = redis.call('HEXISTS', key, 'completed_ms') == 1
  local event = batch_event(key)
  if completed_before then return '' end
  return event
end

-- @include limits
-- @include units
-- shadow: a seller's shadow limit (`limits set --shadow`), judged beside the enforced stack and
-- never enforced.
-- Defines: MAX_SHADOW_LOG, judge_shadow

-- A shadow limit (`limits set --shadow`): a stack judged beside the enforced one and never
-- enforced. SHADOW_KEY (hash, no TTL): `counts` and `windows` (as parse_limits takes them), and
-- how many decisions it `agree`d with, would have held back (`stricter`: the call was granted but
-- a shadow window had no room for it; `delay_ms` adds up by how long) or would have let go at once
-- (`looser`: the caller was told to wait, every shadow window had room). SHADOW_LOG_KEY (sorted
-- set): the units granted, score = grant time, within the shadow's longest window and at most its
-- largest COUNT of them (the newest: older ones cannot decide anything), and never more than
-- MAX_SHADOW_LOG (a shadow COUNT above it is refused when set: permit::admin::MAX_SHADOW_COUNT
-- in Rust, which src/permit/scripts.rs checks equal). Windows are judged without a guard. Sets
-- a.verdict (the answer's last field); nothing without a shadow.
local MAX_SHADOW_LOG = 10000
local function judge_shadow(a, now, granted)
  if a.shadow == nil then return end
  local s = redis.call('HMGET', a.shadow, 'counts', 'windows')
  local limits = parse_limits(s[1], s[2])
  if limits == nil then return end
  with_spans(limits, 0)
  redis.call('ZREMRANGEBYSCORE', a.shadow_log, '-inf', now - limits.max_window)
  local wait = 0
  for _, l in ipairs(limits) do
    local room = l.count - a.cost
    if room < 0 then
      wait = math.max(wait, l.window)
    else
      local n = redis.call('ZCOUNT', a.shadow_log, string.format('(%.0f', now - l.window), '+inf')
      if n > room then
        local kth = tonumber(redis.call('ZREVRANGE', a.shadow_log, room, room, 'WITHSCORES')[2])
        wait = math.max(wait, kth + l.window - now)
      end
    end
  end
  local verdict = 'agree'
  if granted then
    if wait > 0 then
      verdict = 'stricter'
      redis.call('HINCRBY', a.shadow, 'delay_ms', math.ceil(wait / 1000))
    end
    add_units(a.shadow_log, now, a.token, a.cost)
    redis.call('ZREMRANGEBYRANK', a.shadow_log, 0, -(math.min(limits.max_count, MAX_SHADOW_LOG) + 1))
    redis.call('PEXPIRE', a.shadow_log, math.floor(limits.max_window / 1000) + 1)
  elseif wait == 0 then
    verdict = 'looser'
  end
  redis.call('HINCRBY', a.shadow, verdict, 1)
  a.verdict = verdict
end

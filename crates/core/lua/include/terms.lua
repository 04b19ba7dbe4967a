-- @include limits
-- terms: the stack that applies to a seller: its override, else the default, with the counts
-- adaptive limits learned and the downstream's quota (see learn.lua). Reads only.
-- Defines: with_learned, effective_limits

-- Adaptive limits: the seller's learned state (hash LEARNED_KEY, written by learn.lua; see there)
-- lowers the counts of the stack it was learned under (`terms`, "COUNTS WINDOWS_US"). The stack
-- that applies is CONFIGURED with each count min(configured, learned), but never below COST where
-- the configured count allows COST (a call the configured stack can grant is never refused for a
-- learned count). A learned state for other terms (the limit changed since) is ignored. The
-- downstream's quota (`left` units until `until` µs, from rate-limit headers) is read with it, as
-- `quota_left` and `quota_until`; `configured` is CONFIGURED. Returns CONFIGURED when nothing is
-- learned.
local function with_learned(learned_key, configured, cost)
  local s = redis.call('HMGET', learned_key, 'terms', 'counts', 'left', 'until')
  if s[1] ~= configured.counts .. ' ' .. configured.windows then return configured end
  local learned = parse_limits(s[2], configured.windows)
  if learned == nil or #learned ~= #configured then return configured end
  local counts, sign = {}, {}
  for i, l in ipairs(learned) do
    local c = configured[i].count
    sign[i] = math.min(c, l.count)
    l.count = math.min(c, math.max(l.count, math.min(cost, c)))
    counts[i] = l.count
  end
  learned.counts = csv(counts)
  -- The counts a call of cost 1 gets: the stack as gcra's state keeps it (see stack_sign).
  learned.sign_counts = csv(sign)
  learned.configured = configured
  learned.quota_left = tonumber(s[3])
  learned.quota_until = tonumber(s[4])
  return learned
end

-- The stack that applies: the seller's override ("COUNTS WINDOWS_US", e.g. "6,20 1000000,5000000")
-- if set and well-formed, else DEFAULT; with LEARNED_KEY (adaptive limits on), its learned counts
-- for a call of COST (see with_learned).
local function effective_limits(override_key, default, learned_key, cost)
  local configured = default
  local override = redis.call('GET', override_key)
  if override then
    local limits = parse_limits(string.match(override, '^([%d,]+) ([%d,@]+)$'))
    if limits then configured = limits end
  end
  if learned_key == nil then return configured end
  return with_learned(learned_key, configured, cost or 1)
end

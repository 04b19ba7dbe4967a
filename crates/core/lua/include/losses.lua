-- @include pauses
-- losses: detecting state a Redis may have lost (a restart, a promoted replica, evictions, a
-- flush), and pausing the sellers it concerns (check_server). The server stamp of a seller's
-- state and the loss marker of its hash slot are written here.
-- Defines: info_count, server_info, server, losses_since, check_server, keep_stamp

-- What a section of INFO says a counter is (0 when it does not say).
local function info_count(info, pattern)
  local at = string.find(info, pattern, 1, true)
  if at == nil then return 0 end
  return tonumber(string.match(info, '^%d+', at + #pattern)) or 0
end

-- This Redis server's run id (new at every start, different on every server), uptime in
-- seconds, EVICTED: keys evicted under `maxmemory` since it started, and LOSSES: how often it
-- may have lost keys since it started: EVICTED, and FLUSHALL and FLUSHDB calls (INFO's counters,
-- which CONFIG RESETSTAT resets). Read once per call; with WHOLE false, LOSSES is left out (it
-- needs INFO's commandstats, which costs Redis several times the other two sections together:
-- about 90 µs against 21 on a Redis that has run a few dozen kinds of command).
local server_info = nil
local function server(whole)
  if server_info == nil then
    local ok, info = pcall(redis.call, 'INFO', 'server', 'stats')
    if not ok then -- Redis before 7.0 takes one section at a time
      info = redis.call('INFO', 'server') .. redis.call('INFO', 'stats')
    end
    server_info = {
      run_id = string.match(info, 'run_id:(%x+)') or '',
      uptime = tonumber(string.match(info, 'uptime_in_seconds:(%d+)')),
      evicted = info_count(info, '\nevicted_keys:'),
    }
  end
  if whole and server_info.losses == nil then
    local commands = redis.call('INFO', 'commandstats')
    server_info.losses = server_info.evicted
      + info_count(commands, 'cmdstat_flushall:calls=')
      + info_count(commands, 'cmdstat_flushdb:calls=')
  end
  return server_info
end

-- Since when (µs, Redis time) this server has had its current LOSSES, as first seen from this
-- hash slot: LOSS_KEY is the slot's loss marker ("RUN_ID LOSSES SINCE_US", no TTL, so that an
-- eviction under a volatile policy spares it; see Keyspace::losses). Every key lost went before
-- that moment. nil when the server has lost nothing since it started.
local function losses_since(loss_key, now)
  local s = server(true)
  if s.losses == 0 then return nil end
  if loss_key == nil then error({err = 'ERR turnstile: the loss marker key is missing'}) end
  local marker = redis.call('GET', loss_key)
  if marker then
    local run_id, losses, since = string.match(marker, '^(%x+) (%d+) (%d+)$')
    if run_id == s.run_id and tonumber(losses) == s.losses then return tonumber(since) end
  end
  redis.call('SET', loss_key, s.run_id .. ' ' .. s.losses .. ' ' .. string.format('%.0f', now))
  return now
end

-- A Redis that lost writes may have forgotten grants the downstream still counts: a restart
-- without persistence (everything lost), a restart from an older RDB snapshot or AOF with
-- `everysec` (the last writes lost), a replica promoted while it lagged, and, on a live server,
-- keys evicted under `maxmemory` or flushed. So, unless DURABLE (the operator says Redis loses
-- no acknowledged write), each seller's state is stamped with the server that wrote it and its
-- evictions then ("RUN_ID:LOSSES", STAMP_KEY, living as long as the state), and a seller asked
-- about when the stamp is not the current one is paused first:
--   * on a server that started less than SPAN ago, until SPAN after the start: every grant the
--     lost writes held was made before the start, so none of them is in any window by then;
--   * on a server up for longer whose stamp names another server (a replica promoted, data
--     moved), until SPAN from now: the former server's last grants were made before now;
--   * on a server that lost keys (evictions, a flush), until SPAN after the moment its current
--     LOSSES were first seen (losses_since): every grant lost was made before then. This holds
--     whether the seller's stamp went too or not;
--   * without a stamp on a server up for longer than SPAN that lost nothing: a new or long-idle
--     seller (or one whose very first writes were lost with a lagging replica: see docs/faults.md,
--     Faults).
-- (uptime is whole seconds: the start is taken as late as it can have been.)
-- A pause taken so is sized by the SPAN of the terms in force; its stamp then also says when the
-- SPAN counts from and when the pause ends ("RUN_ID:LOSSES:FROM_US:UNTIL_US"), so that under
-- terms whose SPAN is shorter (a stricter replica of the fleet gone, a raise) the pause, if
-- nothing extended it since, is shortened to FROM_US + SPAN: terms no replica holds any more
-- never keep a seller waiting.
-- The stamp's LOSSES is the server's EVICTED (see server): a flush deletes every key of the
-- database, the stamp with them, so a stamp still there names a server that flushed nothing of
-- it since it was written, and only a seller without one (or with another) needs the flush
-- counts (losses_since). A stamp written by an earlier version (LOSSES with the flushes) is
-- the current one until the server's first flush, then re-stamped once.
-- Returns true when the seller's state was not vouched for by the current stamp.
local function check_server(stamp_key, state_key, pause_key, loss_key, span, now, durable)
  if durable then return false end
  local s = server(false)
  local current = s.run_id .. ':' .. s.evicted
  local stamp = redis.call('GET', stamp_key)
  if stamp == current then return false end
  local vouched, from, paused = nil, nil, nil
  if stamp then vouched, from, paused = string.match(stamp, '^(.*):(%d+):(%d+)$') end
  if vouched == current then
    from, paused = tonumber(from), tonumber(paused)
    local due = from + span
    if paused > now and due < paused and paused_until(pause_key) == paused then
      if due > now then
        redis.call('SET', pause_key, string.format('%.0f', due), 'PX', math.floor((due - now) / 1000) + 1)
      else
        redis.call('DEL', pause_key)
      end
      redis.call('SET', stamp_key, current .. ':' .. string.format('%.0f', from) .. ':' ..
        string.format('%.0f', due), 'KEEPTTL')
    elseif paused <= now then
      redis.call('SET', stamp_key, current, 'KEEPTTL') -- the pause is over: the plain stamp
    end
    return false
  end
  local until_us = 0
  if s.uptime ~= nil and s.uptime * 1000000 < span then
    until_us = now - s.uptime * 1000000 + span
  elseif stamp and string.match(stamp, '^[^:]*') ~= s.run_id then
    until_us = now + span
  end
  local lost = losses_since(loss_key, now)
  if lost ~= nil then until_us = math.max(until_us, lost + span) end
  local stamped = current
  if until_us > now and extend_pause(pause_key, until_us, now) == until_us then
    stamped = current .. ':' .. string.format('%.0f', until_us - span) .. ':' ..
      string.format('%.0f', until_us)
  end
  local ttl = math.max(redis.call('PTTL', state_key), math.floor(span / 1000)) + 1
  redis.call('SET', stamp_key, stamped, 'PX', ttl)
  return true
end

-- Keeps the server stamp as long as the state it vouches for (TTL in ms).
local function keep_stamp(stamp_key, ttl, durable)
  if not durable then redis.call('PEXPIRE', stamp_key, ttl) end
end

-- Reads a feed (see lib.lua): the changes after a position, each with its
-- record as it is now (absent: a tombstone), in one step (F1, F2).
--
-- KEYS: 1 the feed's sorted set (a tenant's, the trays', or one env's),
--       2 its counter, 3 its horizon
-- ARGV: 1 'tenant' or 'trays', 2 and 3 the prefixes of its records' hashes
--       (a tenant's runs `r:` and sessions `s:`; the trays' `y:` and the
--       instances' `i:`), 4 after (a decimal u64), 5 most changes to read
-- Returns: {'pruned', horizon} when changes after `after` may have been
-- pruned (F6: FeedPruned); else {'ok', then per change: member, position, '1' and the
-- stored value (a tray's or run's or session's record, an alarm's due_at)
-- or '0' and '' for a tombstone}.
local fd, horizon_key = KEYS[1], KEYS[3]
local scope, a, b, after, limit = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local horizon = redis.call('GET', horizon_key) or '0'
if lt_dec(after, horizon) then return {'pruned', horizon} end

-- The one string component of a member after its table byte, unescaped.
local function component(m, from)
  local e = string.find(m, '\0\1', from, true)
  if not e then error('agentstate: malformed feed member') end
  return (string.gsub(string.sub(m, from, e - 1), '%z\255', '\0')), e + 2
end

local out = {'ok'}
local got = redis.call('ZRANGEBYSCORE', fd, '(' .. after, '+inf', 'WITHSCORES', 'LIMIT', 0, limit)
for i = 1, #got, 2 do
  local m = got[i]
  local v
  if scope == 'tenant' then
    local kind = string.sub(m, 1, 1)
    local id = component(m, 2)
    if kind == 'r' then
      v = redis.call('HGET', a .. id, 'v')
    elseif kind == 's' then
      v = redis.call('HGET', b .. id, 'v')
    else
      error('agentstate: malformed feed member')
    end
  else
    -- An instance (ns, id), alone for its alarm, or with a tray after it.
    local _, at = component(m, 2)
    _, at = component(m, at)
    if at > #m then
      v = redis.call('HGET', b .. m, 'al')
    else
      v = redis.call('HGET', a .. m, 'v')
    end
  end
  out[#out + 1] = m
  out[#out + 1] = got[i + 1]
  if v then
    out[#out + 1] = '1'
    out[#out + 1] = v
  else
    out[#out + 1] = '0'
    out[#out + 1] = ''
  end
end
return out

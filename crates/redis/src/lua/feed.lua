-- The feed's own writes (see lib.lua).
--
-- prune (F6): drops a feed's tombstones at or before a position, a batch at a
-- time, after moving its horizon there (so no reader after an older
-- position can miss a tombstone already dropped).
--   KEYS: 1 the feed's sorted set (a tenant's or the trays')
--   ARGV: 1 'prune', 2 'tenant' or 'trays', 3 and 4 the prefixes of its
--         records' hashes (as feed_read.lua), 5 through (a decimal u64),
--         6 the position the batch starts after ('' for the first), 7 how
--         many entries a batch reads at most
--   Returns: {tombstones dropped, the last position read ('' for none),
--   the `through` it pruned through}. The first batch takes `through`, or
--   the feed's head when that is older (a horizon past the head would
--   refuse positions of changes not yet made); later batches pass the
--   one it answered.
--
-- purged (P1, F6): after a tenant's purge, moves its feed's horizon past every
-- position: one position of its own, so a reader that read a record the
-- purge then deleted reads `FeedPruned` rather than a feed without the
-- delete. A tenant that never had a feed is left without one.
--   KEYS: 1 the tenant's feed; ARGV: 1 'purged'
local fd = KEYS[1]
local op = ARGV[1]

-- Moves the horizon forward to `to`.
local function raise(to)
  local h = redis.call('GET', fd .. ':h') or '0'
  if lt_dec(h, to) then
    redis.call('SET', fd .. ':h', to)
    return to
  end
  return h
end

if op == 'purged' then
  if redis.call('EXISTS', fd .. ':n') == 0 then return {'0'} end
  local pos = string.format('%.0f', redis.call('INCR', fd .. ':n'))
  redis.call('DEL', fd)
  raise(pos)
  feed_publish(fd .. ':c', pos)
  return {pos}
elseif op ~= 'prune' then
  error('agentstate: unknown feed operation ' .. tostring(op))
end

local scope, a, b, through, from, batch = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], tonumber(ARGV[7])
if from == '' then
  local head = redis.call('GET', fd .. ':n') or '0'
  if lt_dec(head, through) then through = head end
end
raise(through)
local lo = '-inf'
if from ~= '' then lo = '(' .. from end
local got = redis.call('ZRANGEBYSCORE', fd, lo, through, 'WITHSCORES', 'LIMIT', 0, batch)
local n = 0
for i = 1, #got, 2 do
  local m = got[i]
  local exists
  if scope == 'tenant' then
    local e = string.find(m, '\0\1', 2, true)
    if not e then error('agentstate: malformed feed member') end
    local id = string.gsub(string.sub(m, 2, e - 1), '%z\255', '\0')
    local kind = string.sub(m, 1, 1)
    if kind == 'r' then
      exists = redis.call('EXISTS', a .. id) == 1
    else
      exists = redis.call('EXISTS', b .. id) == 1
    end
  else
    local e1 = string.find(m, '\0\1', 2, true)
    local e2 = e1 and string.find(m, '\0\1', e1 + 2, true)
    if not e2 then error('agentstate: malformed feed member') end
    if e2 + 1 == #m then
      exists = redis.call('HEXISTS', b .. m, 'al') == 1
    else
      exists = redis.call('EXISTS', a .. m) == 1
    end
  end
  if not exists then
    redis.call('ZREM', fd, m)
    if scope == 'trays' then
      local env = redis.call('HGET', fd .. ':g', m)
      if env then
        redis.call('ZREM', fd .. ':e:' .. env, m)
        redis.call('HDEL', fd .. ':g', m)
      end
    end
    n = n + 1
  end
end
local last = ''
if #got > 0 then last = got[#got] end
return {tostring(n), last, through}

-- Every tray operation (T1-T6, A1-A3): the fence check and the writes of
-- one call in one step. All tray, epoch and alarm keys share the
-- `{trays}` hash tag (the sweeper's and the alarm index span instances).
--
-- KEYS: 1 instance hash (ep: epoch, al: due_at, am: its due-index member),
--       2 instance index, 3 the instance's trays (by member),
--       4 the instance's marked trays, 5 all marked trays,
--       6 alarms by due, 7 the trays feed (see lib.lua)
-- ARGV: 1 operation, 2 instance member, 3 caller's epoch, 4 prefix of the
--       instance's tray hashes, 5 prefix of the per-env marked indexes,
--       then the operation's own arguments from 6
local ikey, insts, trays, imarked, marked, due = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local fd = KEYS[7]
local op, inst, epoch, tbase, mebase = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]

-- Writes (head given) or deletes (head nil) one tray, its indexes and its
-- feed entries; true when it existed.
local function set_tray(member, head, hc, m, env, host)
  local tk = tbase .. member
  local old = redis.call('HMGET', tk, 'm', 'e')
  local existed = old[1] ~= false
  if old[1] == '1' then
    redis.call('ZREM', imarked, member)
    redis.call('ZREM', marked, inst .. member)
    redis.call('ZREM', mebase .. old[2], inst .. member)
  end
  if head then
    local flag = '\0'
    if m == '1' then flag = '\1' end
    redis.call('HSET', tk, 'v', seal(head, hc, flag), 'hl', tostring(#head), 'hc', hc,
      'm', m, 'e', env, 'h', host)
    redis.call('ZADD', trays, 0, member)
    if m == '1' then
      redis.call('ZADD', imarked, 0, member)
      redis.call('ZADD', marked, 0, inst .. member)
      redis.call('ZADD', mebase .. env, 0, inst .. member)
    end
    feed_tray(fd, inst .. member, env, existed and old[2] or nil)
  elseif existed then
    redis.call('DEL', tk)
    redis.call('ZREM', trays, member)
    feed_tray(fd, inst .. member, nil, old[2])
  end
  return existed
end

-- Import (into an empty store; see import.lua): no fence, and a record
-- that exists already is refused.
if op == 'import_epoch' then
  if redis.call('HEXISTS', ikey, 'ep') == 1 then return {'conflict', '1'} end
  redis.call('HSET', ikey, 'ep', epoch)
  redis.call('ZADD', insts, 0, inst)
  return {'ok'}
elseif op == 'import_tray' then
  if redis.call('EXISTS', tbase .. ARGV[6]) == 1 then return {'conflict', '1'} end
  redis.call('ZADD', insts, 0, inst)
  set_tray(ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11])
  return {'ok'}
elseif op == 'import_alarm' then
  if redis.call('HEXISTS', ikey, 'al') == 1 then return {'conflict', '1'} end
  redis.call('ZADD', due, 0, ARGV[6])
  redis.call('HSET', ikey, 'al', ARGV[7], 'am', ARGV[6])
  redis.call('ZADD', insts, 0, inst)
  feed_note(fd, inst)
  return {'ok'}
end

if op == 'release' then
  -- T4: an older placement's release is a no-op, not an error.
  local stored = redis.call('HGET', ikey, 'ep')
  if stored and lt_dec(epoch, stored) then return {'ok'} end
end

local lost = fence(ikey, insts, inst, epoch)
if lost then return lost end

if op == 'read' then
  local v = redis.call('HGET', tbase .. ARGV[6], 'v')
  if not v then return {'none'} end
  return {'ok', v}
elseif op == 'write' then
  redis.call('ZADD', insts, 0, inst)
  set_tray(ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11])
  return {'ok'}
elseif op == 'delete' then
  if set_tray(ARGV[6], nil) then return {'ok', '1'} end
  return {'ok', '0'}
elseif op == 'batch' then
  -- T3: every input was checked before the call, and the fence above is
  -- the only refusal, so the writes below all happen or none does.
  redis.call('ZADD', insts, 0, inst)
  local i = 6
  while i <= #ARGV do
    if ARGV[i] == 'p' then
      set_tray(ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], ARGV[i + 6])
      i = i + 7
    else
      set_tray(ARGV[i + 1], nil)
      i = i + 2
    end
  end
  return {'ok'}
elseif op == 'release' then
  for _, member in ipairs(redis.call('ZRANGE', imarked, 0, -1)) do
    local tk = tbase .. member
    local t = redis.call('HMGET', tk, 'v', 'hl', 'hc', 'e')
    local head = string.sub(t[1], 1, tonumber(t[2]))
    redis.call('HSET', tk, 'v', seal(head, t[3], '\0'), 'm', '0')
    redis.call('ZREM', marked, inst .. member)
    redis.call('ZREM', mebase .. t[4], inst .. member)
    feed_tray(fd, inst .. member, t[4], t[4])
  end
  redis.call('DEL', imarked)
  return {'ok'}
elseif op == 'list' then
  local from = '-'
  if ARGV[6] ~= '' then from = '(' .. ARGV[6] end
  local out = {'ok'}
  for _, member in ipairs(redis.call('ZRANGEBYLEX', trays, from, '+', 'LIMIT', 0, tonumber(ARGV[7]))) do
    out[#out + 1] = member
    out[#out + 1] = redis.call('HGET', tbase .. member, 'v')
  end
  return out
elseif op == 'trays' then
  -- T7: every tray of the instance in member order, in this one step
  -- after the fence. ARGV 6 and 7 bound the members (a tray namespace's
  -- range, or '-' and '+'), 8 is the marked filter ('1', '0' or '' for
  -- none); the marked ones are read from the instance's marked index,
  -- the unmarked ones by each tray's flag.
  local want = ARGV[8]
  local out = {'ok'}
  if want == '0' then
    for _, member in ipairs(redis.call('ZRANGEBYLEX', trays, ARGV[6], ARGV[7])) do
      local t = redis.call('HMGET', tbase .. member, 'v', 'm')
      if t[2] == '0' then
        out[#out + 1] = member
        out[#out + 1] = t[1]
      end
    end
    return out
  end
  local src = trays
  if want == '1' then src = imarked end
  for _, member in ipairs(redis.call('ZRANGEBYLEX', src, ARGV[6], ARGV[7])) do
    out[#out + 1] = member
    out[#out + 1] = redis.call('HGET', tbase .. member, 'v')
  end
  return out
elseif op == 'alarm' then
  -- A1: one alarm per instance; a new one replaces it.
  local old = redis.call('HGET', ikey, 'am')
  if old then redis.call('ZREM', due, old) end
  redis.call('ZADD', due, 0, ARGV[6])
  redis.call('HSET', ikey, 'al', ARGV[7], 'am', ARGV[6])
  redis.call('ZADD', insts, 0, inst)
  feed_note(fd, inst)
  return {'ok'}
elseif op == 'ack' then
  -- A3: an ack for a due_at that has since been replaced removes nothing.
  local s = redis.call('HMGET', ikey, 'al', 'am')
  if s[1] ~= ARGV[6] then return {'ok', '0'} end
  redis.call('ZREM', due, s[2])
  redis.call('HDEL', ikey, 'al', 'am')
  feed_note(fd, inst)
  return {'ok', '1'}
elseif op == 'fence' then
  return {'ok'}
end
error('agentstate: unknown tray operation ' .. tostring(op))

-- delete_run: deletes one run at the caller's version, or, with none
-- stated, only when it is finished (R10); its indexes and live holds go
-- with it, and it stays in its tenant's feed as a tombstone, in one step. What it spent stays spent against its budget.
--
-- KEYS: 1 run hash, 2 runs by seq
-- ARGV: 1 tenant key prefix, 2 run id, 3 expected version ('' for none)
local run, prefix, id, expected = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local s = redis.call('HMGET', run, 'v', 'ver', 'st', 'ss', 'bg', 'lb')
if not s[1] then return {'notfound'} end
local finished = {['4'] = true, ['5'] = true, ['6'] = true}
if expected ~= '' then
  if expected ~= s[2] then return {'conflict', s[2]} end
elseif not finished[s[3]] then
  return {'inuse'}
end
drop_run_holds(prefix, id, s[5])
drop_labels(prefix, id, s[6])
redis.call('DEL', run)
redis.call('ZREM', KEYS[2], id)
redis.call('ZREM', prefix .. 'st:' .. s[3], id)
if s[4] and s[4] ~= '' then redis.call('ZREM', prefix .. 'ss:' .. s[4], id) end
feed_note(prefix .. 'fd', run_member(id))
return {'ok', s[1]}

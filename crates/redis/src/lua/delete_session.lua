-- delete_session: refuses while the session has unfinished runs (S2), or
-- with cascade deletes the session and all its runs (S3), in one step; each
-- is a tombstone in the tenant's feed.
--
-- KEYS: 1 session hash, 2 the tenant's sessions, 3 the session's runs,
--       4 runs by seq
-- ARGV: 1 tenant key prefix, 2 session id, 3 '1' to cascade
local prefix, id, cascade = ARGV[1], ARGV[2], ARGV[3] == '1'
if redis.call('EXISTS', KEYS[1]) == 0 then return {'notfound'} end
local runs = redis.call('ZRANGE', KEYS[3], 0, -1)
local finished = {['4'] = true, ['5'] = true, ['6'] = true}
local states = {}
local live = {}
for i, run_id in ipairs(runs) do
  local st = redis.call('HGET', prefix .. 'r:' .. run_id, 'st')
  if not st then error('agentstate: session index names missing run ' .. run_id) end
  states[i] = st
  if not finished[st] then live[#live + 1] = run_id end
end
if not cascade then
  if #live > 0 then
    table.insert(live, 1, 'inuse')
    return live
  end
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], id)
  feed_note(prefix .. 'fd', session_member(id))
  return {'ok'}
end
for i, run_id in ipairs(runs) do
  local r = redis.call('HMGET', prefix .. 'r:' .. run_id, 'bg', 'lb')
  drop_run_holds(prefix, run_id, r[1])
  drop_labels(prefix, run_id, r[2])
  redis.call('DEL', prefix .. 'r:' .. run_id)
  redis.call('ZREM', KEYS[4], run_id)
  redis.call('ZREM', prefix .. 'st:' .. states[i], run_id)
  feed_note(prefix .. 'fd', run_member(run_id))
end
redis.call('DEL', KEYS[1], KEYS[3])
redis.call('ZREM', KEYS[2], id)
feed_note(prefix .. 'fd', session_member(id))
table.insert(runs, 1, 'ok')
return runs

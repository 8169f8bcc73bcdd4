-- prune: deletes the given runs of a tenant that are still finished and
-- were last written before the cut-off; re-checked here, so a run revived
-- or rewritten since the client chose it stays. Each deleted run is a
-- tombstone in the tenant's feed.
--
-- KEYS: 1 runs by seq
-- ARGV: 1 tenant key prefix, 2 finished_before, 3.. run ids
-- Returns: how many were deleted, as a string
local prefix, before = ARGV[1], ARGV[2]
local finished = {['4'] = true, ['5'] = true, ['6'] = true}
local n = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  local key = prefix .. 'r:' .. id
  local r = redis.call('HMGET', key, 'st', 'ua', 'ss', 'bg', 'lb')
  if r[1] and finished[r[1]] and lt_dec(r[2], before) then
    drop_run_holds(prefix, id, r[4])
    drop_labels(prefix, id, r[5])
    redis.call('DEL', key)
    redis.call('ZREM', KEYS[1], id)
    redis.call('ZREM', prefix .. 'st:' .. r[1], id)
    if r[3] then redis.call('ZREM', prefix .. 'ss:' .. r[3], id) end
    feed_note(prefix .. 'fd', run_member(id))
    n = n + 1
  end
end
return tostring(n)

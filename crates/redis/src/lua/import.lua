-- Import of one exported run or session into an empty store, keeping its
-- version, seq and timestamps; a record that exists, or a seq the tenant
-- already uses, is refused.
--
-- Run:     KEYS 1 run hash, 2 tenant seq counter, 3 runs by seq,
--          4 session's runs by seq
--          ARGV 1 'run', 2 tenant key prefix, 3 run id, 4 record, 5 head
--          length, 6 head CRC, 7 version, 8 seq, 9 state tag, 10 session
--          ('' none), 11 agent, 12 created_at, 13 updated_at,
--          14..18 messages_read, input_tokens, output_tokens,
--          cost_micros, iterations, 19 caps ('- - -' for none),
--          20 budget ('' for none), 21 label field ('' for none; see
--          lib.lua)
-- Session: KEYS 1 session hash, 2 the tenant's sessions
--          ARGV 1 'session', 2 session id, 3 record, 4 version,
--          5 created_at, 6 tenant key prefix
-- Each record imported enters its tenant's feed.
if ARGV[1] == 'session' then
  local ver = redis.call('HGET', KEYS[1], 'ver')
  if ver then return {'conflict', ver} end
  redis.call('HSET', KEYS[1], 'v', ARGV[3], 'ver', ARGV[4], 'ca', ARGV[5])
  redis.call('ZADD', KEYS[2], 0, ARGV[2])
  feed_note(ARGV[6] .. 'fd', session_member(ARGV[2]))
  return {'ok'}
end
local prefix, id, seq, state, session = ARGV[2], ARGV[3], ARGV[8], ARGV[9], ARGV[10]
local ver = redis.call('HGET', KEYS[1], 'ver')
if ver then return {'conflict', ver} end
if #redis.call('ZRANGEBYSCORE', KEYS[3], seq, seq, 'LIMIT', 0, 1) > 0 then
  return {'seqused'}
end
local counter = redis.call('GET', KEYS[2]) or '0'
if lt_dec(counter, seq) then redis.call('SET', KEYS[2], seq) end
redis.call('HSET', KEYS[1], 'v', ARGV[4], 'hl', ARGV[5], 'hc', ARGV[6], 'ver', ARGV[7], 'seq', seq,
  'st', state, 'ag', ARGV[11], 'ca', ARGV[12], 'ua', ARGV[13],
  'mr', ARGV[14], 'it', ARGV[15], 'ot', ARGV[16], 'co', ARGV[17], 'ir', ARGV[18])
if ARGV[19] ~= '- - -' then redis.call('HSET', KEYS[1], 'cp', ARGV[19]) end
if ARGV[20] ~= '' then redis.call('HSET', KEYS[1], 'bg', ARGV[20]) end
if session ~= '' then
  redis.call('HSET', KEYS[1], 'ss', session)
  redis.call('ZADD', KEYS[4], seq, id)
end
redis.call('ZADD', KEYS[3], seq, id)
redis.call('ZADD', prefix .. 'st:' .. state, seq, id)
relabel(prefix, KEYS[1], id, seq, false, ARGV[21])
feed_note(prefix .. 'fd', run_member(id))
return {'ok'}

-- put_run: create (expected version 0) or versioned update of one run
-- (R2, R6, R8, R9, R11), its indexes, the tenant's seq (L2) and its
-- feed, in one step: of two racing writers only one passes (R3).
--
-- KEYS: 1 run hash, 2 tenant seq counter, 3 runs by seq, 4 session hash,
--       5 session's runs by seq (4 and 5 only read/written with a session)
-- ARGV: 1 tenant key prefix, 2 run id, 3 expected version, 4 head bytes,
--       5 head CRC, 6 state tag, 7 session id ('' for none), 8 agent,
--       9 now, 10..14 messages_read, input_tokens, output_tokens,
--       cost_micros, iterations, 15 largest record in bytes, 16 caps
--       ('cost tokens iterations', '-' for none), 17 budget ('' for none),
--       18 the finished states as `tag:name,…`, 19 the new state's name,
--       20 the run's label field ('' for no labels; see lib.lua)
local run, prefix, id, expected = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local head, head_crc, state, session, agent, now = ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local amounts = {ARGV[10], ARGV[11], ARGV[12], ARGV[13], ARGV[14]}
local max = tonumber(ARGV[15])
local caps, budget = ARGV[16], ARGV[17]
local labels = ARGV[20]
local NO_CAPS = '- - -'

local function tail_of(a, ver, ca, ua, seq)
  return varint(a[1]) .. varint(a[2]) .. varint(a[3]) .. varint(a[4]) .. varint(a[5])
    .. varint(ver) .. varint(ca) .. varint(ua) .. varint(seq)
end

local stored = redis.call('HMGET', run, 'ver', 'seq', 'st', 'ss', 'ca', 'mr', 'it', 'ot', 'co', 'ir', 'cp', 'bg', 'lb')
if not stored[1] then
  -- R2: version 0 creates; anything else names a run that is gone.
  if expected ~= '0' then return {'conflict', '0'} end
  -- R8: a run's session exists at create.
  if session ~= '' and redis.call('EXISTS', KEYS[4]) == 0 then return {'nosession'} end
  -- B1: so does its budget.
  if budget ~= '' and redis.call('EXISTS', prefix .. 'b:' .. budget) == 0 then return {'nobudget'} end
  -- The next seq, taken only once nothing refuses (a refusal writes nothing).
  local seq = add_dec(redis.call('GET', KEYS[2]) or '0', '1')
  local v = seal(head, head_crc, tail_of(amounts, '1', now, now, seq))
  -- K2, as below.
  if #v > max then return {'toolarge', tostring(#v)} end
  redis.call('SET', KEYS[2], seq)
  redis.call('HSET', run, 'v', v, 'hl', tostring(#head), 'hc', head_crc, 'ver', '1', 'seq', seq,
    'st', state, 'ag', agent, 'ca', now, 'ua', now,
    'mr', amounts[1], 'it', amounts[2], 'ot', amounts[3], 'co', amounts[4], 'ir', amounts[5])
  if session ~= '' then
    redis.call('HSET', run, 'ss', session)
    redis.call('ZADD', KEYS[5], seq, id)
  end
  redis.call('ZADD', KEYS[3], seq, id)
  redis.call('ZADD', prefix .. 'st:' .. state, seq, id)
  relabel(prefix, run, id, seq, false, labels)
  if caps ~= NO_CAPS then redis.call('HSET', run, 'cp', caps) end
  if budget ~= '' then
    -- A run created with amounts already spent spends them on its budget.
    redis.call('HSET', run, 'bg', budget)
    spend_on_budget(prefix, budget, amounts[4], sat_add(amounts[2], amounts[3]), amounts[5])
    purge_holds(prefix, id, budget, now)
  end
  feed_note(prefix .. 'fd', run_member(id))
  return {'ok', v}
end

local ver, seq, old_state, old_session, ca = stored[1], stored[2], stored[3], stored[4], stored[5]
-- R2: the stored version must be the one the caller read.
if expected == '0' or expected ~= ver then return {'conflict', ver} end
-- R9, as in rules::updated_run: a finished run stays finished.
local finished = {}
for tag, name in string.gmatch(ARGV[18], '(%d+):([%a_]+)') do finished[tag] = name end
if finished[old_state] and old_state ~= state then
  local was = finished[old_state]
  return {'invalid', 'state: run ' .. id .. ' is ' .. was .. ' and stays ' .. was
    .. ' (a finished run is never moved to ' .. ARGV[19] .. '; R9)'}
end
-- R6, in rules::moved_amount's order: usage, cost_micros, iterations,
-- messages_read.
local moved = nil
if stored[7] ~= amounts[2] or stored[8] ~= amounts[3] then moved = 'usage'
elseif stored[9] ~= amounts[4] then moved = 'cost_micros'
elseif stored[10] ~= amounts[5] then moved = 'iterations'
elseif stored[6] ~= amounts[1] then moved = 'messages_read' end
if moved then
  return {'invalid', moved .. ': put_run cannot change an accumulating amount; use patch_run'}
end
if (old_session or '') ~= session then return {'invalid', 'session_id: fixed at create'} end
-- B1: a run's caps and budget are fixed at create.
if (stored[11] or NO_CAPS) ~= caps then return {'invalid', 'caps: fixed at create'} end
if (stored[12] or '') ~= budget then return {'invalid', 'budget: fixed at create'} end
local next_ver = add_dec(ver, '1')
if next_ver == nil then return {'invalid', 'version: u64 exhausted'} end
local v = seal(head, head_crc, tail_of(amounts, next_ver, ca, now, seq))
-- K2: a record past the store's limit is TooLarge.
if #v > max then return {'toolarge', tostring(#v)} end
redis.call('HSET', run, 'v', v, 'hl', tostring(#head), 'hc', head_crc, 'ver', next_ver,
  'st', state, 'ag', agent, 'ua', now)
if old_state ~= state then
  redis.call('ZREM', prefix .. 'st:' .. old_state, id)
  redis.call('ZADD', prefix .. 'st:' .. state, seq, id)
end
-- R11: a put replaces the labels whole.
relabel(prefix, run, id, seq, stored[13], labels)
feed_note(prefix .. 'fd', run_member(id))
return {'ok', v}

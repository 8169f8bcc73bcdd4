-- list_runs: one page of a tenant's runs from an index (by seq, by state,
-- by session or by label), filtered, read in one atomic step (L1, L2, L4, L5; the session filter
-- S4, the label filter R11).
-- Reads at most `cap` index entries, so a page of a sparse filter never
-- holds the server for long; the client asks again from where it stopped.
--
-- KEYS: 1 the index (a sorted set scored by seq)
-- ARGV: 1 tenant key prefix, 2 the seq the last page ended on ('' for the
--       first page), 3 items wanted, 4 state tag ('' for any), 5 session
--       ('' for any), 6 agent ('' for any), 7 updated_before ('' for
--       none), 8 cap on index entries read, 9 label suffix ('' for any;
--       checked against the run's `lb` field whatever the index)
-- Returns: {last seq read or '', '1' when the index is exhausted,
--           seq, record, seq, record, ...}
local prefix, after, want = ARGV[1], ARGV[2], tonumber(ARGV[3])
local state, session, agent, before, cap = ARGV[4], ARGV[5], ARGV[6], ARGV[7], tonumber(ARGV[8])
local label = ARGV[9]
local out = {'', '0'}
local found, read = 0, 0
local from = '-inf'
if after ~= '' then from = '(' .. after end
while true do
  local chunk = math.min(cap - read, want + 16)
  local entries = redis.call('ZRANGEBYSCORE', KEYS[1], from, '+inf', 'WITHSCORES', 'LIMIT', 0, chunk)
  local n = #entries / 2
  for i = 1, #entries, 2 do
    local id, seq = entries[i], entries[i + 1]
    read = read + 1
    out[1] = seq
    local r = redis.call('HMGET', prefix .. 'r:' .. id, 'v', 'seq', 'st', 'ss', 'ag', 'ua', 'lb')
    if r[1] and r[2] == seq
      and (state == '' or r[3] == state)
      and (session == '' or r[4] == session)
      and (agent == '' or r[5] == agent)
      and (before == '' or lt_dec(r[6], before))
      and (label == '' or has_label(r[7], label)) then
      out[#out + 1] = seq
      out[#out + 1] = r[1]
      found = found + 1
      if found >= want then return out end
    end
  end
  if n < chunk then
    out[2] = '1'
    return out
  end
  if read >= cap then return out end
  from = '(' .. out[1]
end

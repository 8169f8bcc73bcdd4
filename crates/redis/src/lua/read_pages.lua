-- Read-only pages that need more than one command to answer consistently.
--
-- 'marked' (T5): KEYS 1 the marked index (all, or one env's)
--           ARGV 1 'marked', 2 prefix of tray hashes, 3 the member the
--           last page ended on ('' first), 4 items wanted
--           -> {member, env, hostname, ...}
-- 'sessions': KEYS 1 the tenant's sessions
--           ARGV 1 'sessions', 2 prefix of session hashes, 3 after, 4 wanted
--           -> {id, record, ...}
local from = '-'
if ARGV[3] ~= '' then from = '(' .. ARGV[3] end
local out = {}
local members = redis.call('ZRANGEBYLEX', KEYS[1], from, '+', 'LIMIT', 0, tonumber(ARGV[4]))
for _, m in ipairs(members) do
  if ARGV[1] == 'marked' then
    local t = redis.call('HMGET', ARGV[2] .. m, 'e', 'h')
    if not t[1] then error('agentstate: marked index names a missing tray') end
    out[#out + 1] = m
    out[#out + 1] = t[1]
    out[#out + 1] = t[2]
  else
    local v = redis.call('HGET', ARGV[2] .. m, 'v')
    if not v then error('agentstate: session index names a missing session') end
    out[#out + 1] = m
    out[#out + 1] = v
  end
end
return out

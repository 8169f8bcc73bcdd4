-- put_session: create (expected version 0) or versioned update (S1).
--
-- KEYS: 1 session hash, 2 the tenant's sessions (by id)
-- ARGV: 1 session id, 2 expected version, 3 head bytes, 4 head CRC, 5 now,
--       6 largest record in bytes, 7 tenant key prefix
local key, id, expected, head, head_crc, now = KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local max = tonumber(ARGV[6])
local s = redis.call('HMGET', key, 'ver', 'ca')
local ver, ca
if not s[1] then
  if expected ~= '0' then return {'conflict', '0'} end
  ver, ca = '1', now
else
  if expected == '0' or expected ~= s[1] then return {'conflict', s[1]} end
  ver = add_dec(s[1], '1')
  if ver == nil then return {'invalid', 'version: u64 exhausted'} end
  ca = s[2]
end
local v = seal(head, head_crc, varint(ver) .. varint(ca) .. varint(now))
-- K2: a record past the store's limit is TooLarge.
if #v > max then return {'toolarge', tostring(#v)} end
redis.call('HSET', key, 'v', v, 'ver', ver, 'ca', ca)
redis.call('ZADD', KEYS[2], 0, id)
feed_note(ARGV[7] .. 'fd', session_member(id))
return {'ok', v}

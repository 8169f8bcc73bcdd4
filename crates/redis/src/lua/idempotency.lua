
-- Idempotency keys (rules I1-I6), appended after a write script whose body
-- `scripts.rs` wrapped as `local function body(KEYS, ARGV)`: the body sees
-- its usual KEYS and ARGV (the ones after the idempotency arguments below,
-- whatever their number), and every reply it returns is one the crate
-- remembers (a success, or a refusal made before its first write).
--
-- KEYS: 1 the scope's keys (hash: key -> cmsgpack {fingerprint, at,
--       reply}), 2 the scope's keys by ordinal (sorted set, oldest first),
--       then the body's KEYS
-- ARGV: 1 idempotency key, 2 fingerprint (16 bytes), 3 now (the store's
--       clock), 4 ttl in ms, 5 most keys kept, 6 most keys forgotten per
--       call, then the body's ARGV
--
-- A kept key answers its stored reply and writes nothing (I1); with
-- another fingerprint it is the error IDEMREUSED (I3). Otherwise the body
-- runs; before its reply is kept, up to ARGV[6] of the scope's oldest keys
-- that are past the window (kept since at + ttl <= now, or more than
-- ARGV[5] kept) are forgotten, as the engine stores do.
local IK, IO = KEYS[1], KEYS[2]
local ikey, ifp, inow, ittl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ikeys_max, iprune = tonumber(ARGV[5]), tonumber(ARGV[6])

local kept = redis.call('HGET', IK, ikey)
if kept then
  local e = cmsgpack.unpack(kept)
  if e[1] ~= ifp then
    return redis.error_reply('IDEMREUSED idempotency key used for another call')
  end
  return e[3]
end

local bkeys, bargv = {}, {}
for i = 3, #KEYS do bkeys[#bkeys + 1] = KEYS[i] end
for i = 7, #ARGV do bargv[#bargv + 1] = ARGV[i] end
local reply = body(bkeys, bargv)

local n = redis.call('ZCARD', IO)
for _, k in ipairs(redis.call('ZRANGE', IO, 0, iprune - 1)) do
  local e = redis.call('HGET', IK, k)
  -- An order entry without its key is stale: drop it.
  local expired = true
  if e then
    local until_ = add_dec(cmsgpack.unpack(e)[2], ittl)
    expired = until_ ~= nil and not lt_dec(inow, until_)
  end
  if not (expired or n >= ikeys_max) then break end
  redis.call('HDEL', IK, k)
  redis.call('ZREM', IO, k)
  n = n - 1
end
local last = redis.call('ZRANGE', IO, -1, -1, 'WITHSCORES')
local ordinal = 1
if last[2] then ordinal = tonumber(last[2]) + 1 end
redis.call('HSET', IK, ikey, cmsgpack.pack({ifp, inow, reply}))
redis.call('ZADD', IO, ordinal, ikey)
return reply

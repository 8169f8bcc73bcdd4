-- Helpers every write script of the Redis backend shares (prepended to
-- each script by `scripts.rs`).
--
-- u64 values never pass through Lua numbers (doubles, exact only to 2^53):
-- they travel as canonical decimal strings and are computed on as two
-- 32-bit limbs (hi, lo), each exact in a double.

local TWO32 = 4294967296

-- A decimal string as limbs; nil when it is not a u64.
local function limbs(s)
  if type(s) ~= 'string' or #s == 0 or #s > 20 then return nil end
  -- Up to 15 digits (below 2^53, exact in a double), read at once.
  if #s <= 15 and not string.find(s, '%D') then
    local n = tonumber(s)
    local hi = math.floor(n / TWO32)
    return hi, n - hi * TWO32
  end
  local hi, lo = 0, 0
  for i = 1, #s do
    local d = string.byte(s, i) - 48
    if d < 0 or d > 9 then return nil end
    lo = lo * 10 + d
    local carry = math.floor(lo / TWO32)
    lo = lo - carry * TWO32
    hi = hi * 10 + carry
    if hi >= TWO32 then return nil end
  end
  return hi, lo
end

-- Limbs as a canonical decimal string.
local function dec(hi, lo)
  if hi == 0 then return string.format('%.0f', lo) end
  local digits = {}
  while hi > 0 or lo > 0 do
    local r = hi % 10
    hi = (hi - r) / 10
    local x = r * TWO32 + lo
    local d = x % 10
    lo = (x - d) / 10
    digits[#digits + 1] = string.char(48 + d)
  end
  return string.reverse(table.concat(digits))
end

-- a + b on decimal strings; nil on overflow past u64 (the caller refuses).
local function add_dec(a, b)
  local ah, al = limbs(a)
  local bh, bl = limbs(b)
  if ah == nil or bh == nil then error('agentstate: not a u64: ' .. tostring(a) .. ' + ' .. tostring(b)) end
  local lo = al + bl
  local c = 0
  if lo >= TWO32 then lo = lo - TWO32; c = 1 end
  local hi = ah + bh + c
  if hi >= TWO32 then return nil end
  return dec(hi, lo)
end

-- a < b on decimal strings, exactly.
local function lt_dec(a, b)
  local ah, al = limbs(a)
  local bh, bl = limbs(b)
  if ah == nil or bh == nil then error('agentstate: not a u64: ' .. tostring(a) .. ' < ' .. tostring(b)) end
  return ah < bh or (ah == bh and al < bl)
end

-- The postcard varint (LEB128) of a decimal u64.
local function varint(s)
  local hi, lo = limbs(s)
  if hi == nil then error('agentstate: not a u64: ' .. tostring(s)) end
  local out = {}
  while hi > 0 or lo >= 128 do
    local b = lo % 128
    out[#out + 1] = string.char(b + 128)
    local hb = hi % 128
    lo = (lo - b) / 128 + hb * 33554432
    hi = (hi - hb) / 128
  end
  out[#out + 1] = string.char(lo)
  return table.concat(out)
end

-- CRC-32 (IEEE, the one crc32fast computes) of head .. s, given the CRC of
-- head: the client checksums the (large) head, the script only the tail.
-- A nibble at a time from a 16-entry table (the reflected polynomial
-- 0xEDB88320 applied 4 times to each nibble): a quarter of the bit-by-bit
-- loop's work, which was a third of a patch's time on the server.
local CRC_NIBBLE = {
  0x00000000, 0x1DB71064, 0x3B6E20C8, 0x26D930AC,
  0x76DC4190, 0x6B6B51F4, 0x4DB26158, 0x5005713C,
  0xEDB88320, 0xF00F9344, 0xD6D6A3E8, 0xCB61B38C,
  0x9B64C2B0, 0x86D3D2D4, 0xA00AE278, 0xBDBDF21C,
}
local function crc32(crc, s)
  local r = bit.bnot(crc)
  for i = 1, #s do
    r = bit.bxor(r, string.byte(s, i))
    r = bit.bxor(bit.rshift(r, 4), CRC_NIBBLE[bit.band(r, 15) + 1])
    r = bit.bxor(bit.rshift(r, 4), CRC_NIBBLE[bit.band(r, 15) + 1])
  end
  r = bit.bnot(r)
  if r < 0 then r = r + TWO32 end
  return r
end

local function le32(n)
  local b0 = n % 256
  n = (n - b0) / 256
  local b1 = n % 256
  n = (n - b1) / 256
  local b2 = n % 256
  local b3 = (n - b2) / 256
  return string.char(b0, b1, b2, b3)
end

-- A stored value in the crate's codec: head (format byte and the fields
-- the client encoded) .. tail (the fields the script owns) .. CRC-32.
local function seal(head, head_crc, tail)
  return head .. tail .. le32(crc32(tonumber(head_crc), tail))
end

-- T2: a caller below the stored epoch loses (returns the refusal); at or
-- above it, the stored epoch advances to the caller's. `inst` is the
-- instance's member in the instance index.
local function fence(ikey, insts, inst, epoch)
  local stored = redis.call('HGET', ikey, 'ep')
  if not stored then stored = '0' end
  if lt_dec(epoch, stored) then return {'fence', stored} end
  if lt_dec(stored, epoch) then
    redis.call('HSET', ikey, 'ep', epoch)
    redis.call('ZADD', insts, 0, inst)
  end
  return nil
end

-- Spend caps (B1-B6). A tenant's budget `b:<name>` is a hash (ver, ca, ua,
-- caps cc ct ci, '' for none; spent sc st si); `budgets` indexes the names.
-- A run's holds are the hash `h:<run id>` (hold id -> hold), and its
-- budget's the hash `bh:<name>` (`<#run id>:<run id><hold id>` -> hold). A
-- hold is 'cost tokens iterations created_at expires_at' in decimal.
-- `hr` is the lexicographic set of the run ids that have holds.
local U64_MAX = '18446744073709551615'

-- a + b, saturating at u64::MAX (rules::held and rules::budget_spent).
local function sat_add(a, b)
  return add_dec(a, b) or U64_MAX
end

local function parse_hold(s)
  local f = {}
  for w in string.gmatch(s, '%S+') do f[#f + 1] = w end
  return f
end

-- Live while now < expires_at (B5).
local function hold_live(h, now)
  return lt_dec(now, h[5])
end

local function bhold_field(run_id, hold_id)
  return tostring(#run_id) .. ':' .. run_id .. hold_id
end

-- The saturating sums of the live holds of a hold hash, and how many.
local function held_of(key, now)
  local all = redis.call('HGETALL', key)
  local s = {'0', '0', '0'}
  local n = 0
  for i = 2, #all, 2 do
    local h = parse_hold(all[i])
    if hold_live(h, now) then
      s[1] = sat_add(s[1], h[1]); s[2] = sat_add(s[2], h[2]); s[3] = sat_add(s[3], h[3])
      n = n + 1
    end
  end
  return s, n
end

-- Keeps `hr` (the runs that have holds, by id, for export) in step once
-- a run's holds hash may have emptied.
local function holds_gone(prefix, run_id)
  if redis.call('EXISTS', prefix .. 'h:' .. run_id) == 0 then
    redis.call('ZREM', prefix .. 'hr', run_id)
  end
end

-- B5: drops the expired holds of a run and of its budget (writes that go
-- ahead only).
local function purge_holds(prefix, run_id, budget, now)
  local rk = prefix .. 'h:' .. run_id
  local all = redis.call('HGETALL', rk)
  for i = 2, #all, 2 do
    if not hold_live(parse_hold(all[i]), now) then
      redis.call('HDEL', rk, all[i - 1])
      if budget and budget ~= '' then
        redis.call('HDEL', prefix .. 'bh:' .. budget, bhold_field(run_id, all[i - 1]))
      end
    end
  end
  if budget and budget ~= '' then
    local bk = prefix .. 'bh:' .. budget
    local ball = redis.call('HGETALL', bk)
    for i = 2, #ball, 2 do
      if not hold_live(parse_hold(ball[i]), now) then
        local f = ball[i - 1]
        local colon = string.find(f, ':', 1, true)
        local len = tonumber(string.sub(f, 1, colon - 1))
        local rid = string.sub(f, colon + 1, colon + len)
        local hid = string.sub(f, colon + len + 1)
        redis.call('HDEL', bk, f)
        redis.call('HDEL', prefix .. 'h:' .. rid, hid)
        holds_gone(prefix, rid)
      end
    end
  end
  holds_gone(prefix, run_id)
end

-- Deletes every hold of a run (the run is being deleted).
local function drop_run_holds(prefix, run_id, budget)
  local rk = prefix .. 'h:' .. run_id
  if budget and budget ~= '' then
    for _, hid in ipairs(redis.call('HKEYS', rk)) do
      redis.call('HDEL', prefix .. 'bh:' .. budget, bhold_field(run_id, hid))
    end
  end
  redis.call('DEL', rk)
  redis.call('ZREM', prefix .. 'hr', run_id)
end

-- B3/B6: adds spend (cost, tokens, iterations) to a budget, saturating.
local function spend_on_budget(prefix, budget, cost, tokens, iters)
  if not budget or budget == '' then return end
  local bk = prefix .. 'b:' .. budget
  local s = redis.call('HMGET', bk, 'sc', 'st', 'si')
  redis.call('HSET', bk, 'sc', sat_add(s[1], cost), 'st', sat_add(s[2], tokens),
    'si', sat_add(s[3], iters))
end

-- Labels (R11). A run's `lb` field lists its labels as suffixes (the
-- client's keys::label_suffix), each written `<bytes>:<suffix>`; the field
-- is absent when the run has none. The runs carrying one label are the
-- sorted set `lb:<suffix>`, scored by seq.
local function label_list(field)
  local out = {}
  if not field then return out end
  local i = 1
  while i <= #field do
    local colon = string.find(field, ':', i, true)
    local n = colon and tonumber(string.sub(field, i, colon - 1))
    if not n or colon + n > #field then error('agentstate: malformed label field of a run') end
    out[#out + 1] = string.sub(field, colon + 1, colon + n)
    i = colon + n + 1
  end
  return out
end

-- True when a run's `lb` field holds the label `suffix`.
local function has_label(field, suffix)
  for _, s in ipairs(label_list(field)) do
    if s == suffix then return true end
  end
  return false
end

-- Moves run `id` (at `seq`, hash `run`) from the label indexes of its
-- stored field `old` (false for none) to those of `new` ('' for none) and
-- stores `new`; nothing to do when they are the same.
local function relabel(prefix, run, id, seq, old, new)
  old = old or ''
  if old == new then return end
  local was, now = {}, {}
  for _, s in ipairs(label_list(old)) do was[s] = true end
  for _, s in ipairs(label_list(new)) do
    now[s] = true
    if not was[s] then redis.call('ZADD', prefix .. 'lb:' .. s, seq, id) end
  end
  for s in pairs(was) do
    if not now[s] then redis.call('ZREM', prefix .. 'lb:' .. s, id) end
  end
  if new == '' then
    redis.call('HDEL', run, 'lb')
  else
    redis.call('HSET', run, 'lb', new)
  end
end

-- Removes run `id` from the label indexes of its field (it is being
-- deleted).
local function drop_labels(prefix, id, field)
  for _, s in ipairs(label_list(field)) do
    redis.call('ZREM', prefix .. 'lb:' .. s, id)
  end
end

-- The change feed (F1-F8). A scope's feed is the sorted set `fd` (a
-- tenant's `as:{t…}:fd`, the store's trays' and alarms' `as:{trays}:fd`):
-- each record's member once (its identity in the key codec), scored by
-- the position of its last change, taken from the counter `fd .. ':n'`
-- (one INCR per changed record, so positions strictly increase; Redis runs
-- one script at a time, so no commit is ever seen out of order). A deleted
-- record keeps its member (a tombstone): the reader finds it absent.
-- `fd .. ':h'` is the horizon (positions before it read `FeedPruned`).
-- Every script that changes a feed publishes on `fd .. ':c'` (once), which
-- wakes the waiters. The trays feed also keeps each env's trays in
-- `fd .. ':e:' .. env` (channel `fd .. ':c:' .. env`), and a deleted
-- tray's last env in the hash `fd .. ':g'`, for the prune.

-- A string component of the key codec (codec::key): NULs escaped, terminated.
local function kc(s)
  return (string.gsub(s, '%z', '\0\255')) .. '\0\1'
end

-- A run's and a session's member in their tenant's feed.
local function run_member(id) return 'r' .. kc(id) end
local function session_member(id) return 's' .. kc(id) end

-- Publishes each feed channel once per script. A server that refuses
-- (an ACL user without the channel) fails no write: `pcall` answers the
-- error instead of raising it, and waiters poll (they cannot subscribe
-- either).
local feed_published = {}
local function feed_publish(channel, pos)
  if not feed_published[channel] then
    feed_published[channel] = true
    redis.pcall('PUBLISH', channel, pos)
  end
end

-- Moves `member` to the next position of the feed `fd`; answers the
-- position (a decimal string).
local function feed_note(fd, member)
  local pos = string.format('%.0f', redis.call('INCR', fd .. ':n'))
  redis.call('ZADD', fd, pos, member)
  feed_publish(fd .. ':c', pos)
  return pos
end

-- A tray's change in the trays feed `fd` and its env's: `env` is its env
-- now (nil once deleted), `old` the env of its last write (nil when it did
-- not exist). A tray that changed env leaves the old env's feed (so does
-- a tombstone written again in another env); a deleted one stays in its
-- last env's, as a tombstone.
local function feed_tray(fd, member, env, old)
  local pos = feed_note(fd, member)
  if env and old and old ~= env then redis.call('ZREM', fd .. ':e:' .. old, member) end
  local e = env or old
  if e then
    redis.call('ZADD', fd .. ':e:' .. e, pos, member)
    feed_publish(fd .. ':c:' .. e, pos)
  end
  if not env and old then
    redis.call('HSET', fd .. ':g', member, old)
  elseif env and not old then
    -- Written again after a delete: its tombstone leaves the env it
    -- was deleted in, when that was another.
    local was = redis.call('HGET', fd .. ':g', member)
    if was then
      redis.call('HDEL', fd .. ':g', member)
      if was ~= env then redis.call('ZREM', fd .. ':e:' .. was, member) end
    end
  end
end

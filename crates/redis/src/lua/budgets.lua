-- budgets: the writes of spend caps (B1-B5) on one tenant's hash tag, one
-- step each; every refusal comes before the first write (E6). The decisions
-- mirror rules::budget (check order: the run's caps, then the budget's;
-- cost, tokens, iterations; sums exact, never past u64).
--
-- ARGV[1] names the operation, ARGV[2] the tenant key prefix:
--   put_budget NAME EXPECTED_VERSION CAPS NOW
--   reserve RUN_ID HOLD_ID COST TOKENS ITERATIONS TTL NOW HOLDS_MAX
--   release RUN_ID HOLD_ID NOW
--   import_budget NAME VERSION CREATED_AT UPDATED_AT CAPS SPENT(3)
--   import_hold RUN_ID HOLD_ID HOLD
-- CAPS is 'cost tokens iterations', '-' for no cap.
local op, prefix = ARGV[1], ARGV[2]

local function split(s)
  local f = {}
  for w in string.gmatch(s, '%S+') do f[#f + 1] = w end
  return f
end

-- One scope's B2 check: nil, or the refusal naming the first cap passed.
local function fits(scope, caps, spent, held, asked)
  for i = 1, 3 do
    local max = caps[i]
    if max ~= '-' then
      local sh = add_dec(spent[i], held[i])
      local total = sh and add_dec(sh, asked[i])
      if total == nil or lt_dec(max, total) then
        return {'exceeded', scope, tostring(i), max, spent[i], held[i], asked[i]}
      end
    end
  end
  return nil
end

if op == 'put_budget' then
  local name, expected, caps, now = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
  local bk = prefix .. 'b:' .. name
  local s = redis.call('HMGET', bk, 'ver', 'ca')
  local c = split(caps)
  local function capv(x) if x == '-' then return '' end return x end
  if not s[1] then
    if expected ~= '0' then return {'conflict', '0'} end
    redis.call('HSET', bk, 'ver', '1', 'ca', now, 'ua', now, 'cp', caps,
      'sc', '0', 'st', '0', 'si', '0')
    redis.call('ZADD', prefix .. 'budgets', 0, name)
    return {'ok', '1', now, now}
  end
  if expected == '0' or expected ~= s[1] then return {'conflict', s[1]} end
  local ver = add_dec(s[1], '1')
  if ver == nil then return {'invalid', 'version: u64 exhausted'} end
  redis.call('HSET', bk, 'ver', ver, 'ua', now, 'cp', caps)
  return {'ok', ver, s[2], now}
end

if op == 'reserve' then
  local run_id, hold_id, now = ARGV[3], ARGV[4], ARGV[9]
  local asked = {ARGV[5], ARGV[6], ARGV[7]}
  local ttl, holds_max = ARGV[8], tonumber(ARGV[10])
  local r = redis.call('HMGET', prefix .. 'r:' .. run_id, 'it', 'ot', 'co', 'ir', 'cp', 'bg')
  if not r[1] then return {'notfound'} end
  local budget = r[6]
  -- B2: a hold id names one live hold; a run holds at most holds_max.
  local hk = prefix .. 'h:' .. run_id
  local all = redis.call('HGETALL', hk)
  local run_held = {'0', '0', '0'}
  local live = 0
  for i = 2, #all, 2 do
    local h = parse_hold(all[i])
    if hold_live(h, now) then
      if all[i - 1] == hold_id then return {'duphold'} end
      live = live + 1
      run_held[1] = sat_add(run_held[1], h[1])
      run_held[2] = sat_add(run_held[2], h[2])
      run_held[3] = sat_add(run_held[3], h[3])
    end
  end
  if live >= holds_max then return {'toomany'} end
  local b = nil
  if budget then
    b = redis.call('HMGET', prefix .. 'b:' .. budget, 'cp', 'sc', 'st', 'si')
    if not b[1] then return {'nobudget', budget} end
  end
  local refused = fits('run', split(r[5] or '- - -'), {r[3], sat_add(r[1], r[2]), r[4]},
    run_held, asked)
  if refused then return refused end
  if b then
    local bheld = held_of(prefix .. 'bh:' .. budget, now)
    refused = fits('budget', split(b[1]), {b[2], b[3], b[4]}, bheld, asked)
    if refused then
      refused[#refused + 1] = budget
      return refused
    end
  end
  local expires = add_dec(now, ttl)
  if expires == nil then return {'invalid', 'hold ttl_millis: the clock plus the ttl overflows'} end
  purge_holds(prefix, run_id, budget, now)
  local v = asked[1] .. ' ' .. asked[2] .. ' ' .. asked[3] .. ' ' .. now .. ' ' .. expires
  redis.call('HSET', hk, hold_id, v)
  redis.call('ZADD', prefix .. 'hr', 0, run_id)
  if budget then redis.call('HSET', prefix .. 'bh:' .. budget, bhold_field(run_id, hold_id), v) end
  return {'ok', now, expires}
end

if op == 'release' then
  local run_id, hold_id, now = ARGV[3], ARGV[4], ARGV[5]
  local r = redis.call('HMGET', prefix .. 'r:' .. run_id, 'ver', 'bg')
  if not r[1] then return {'notfound'} end
  local budget = r[2]
  local hk = prefix .. 'h:' .. run_id
  local h = redis.call('HGET', hk, hold_id)
  if not h or not hold_live(parse_hold(h), now) then return {'nohold'} end
  redis.call('HDEL', hk, hold_id)
  if budget then redis.call('HDEL', prefix .. 'bh:' .. budget, bhold_field(run_id, hold_id)) end
  purge_holds(prefix, run_id, budget, now)
  return {'ok'}
end

-- Import into an empty store (export order: runs, then holds; budgets
-- come after, so a hold does not need its budget yet).
if op == 'import_budget' then
  local name, ver, ca, ua, caps = ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
  local bk = prefix .. 'b:' .. name
  local stored = redis.call('HGET', bk, 'ver')
  if stored then return {'conflict', stored} end
  redis.call('HSET', bk, 'ver', ver, 'ca', ca, 'ua', ua, 'cp', caps,
    'sc', ARGV[8], 'st', ARGV[9], 'si', ARGV[10])
  redis.call('ZADD', prefix .. 'budgets', 0, name)
  return {'ok'}
end

if op == 'import_hold' then
  local run_id, hold_id, v = ARGV[3], ARGV[4], ARGV[5]
  local hk = prefix .. 'h:' .. run_id
  if redis.call('HEXISTS', hk, hold_id) == 1 then return {'conflict', '1'} end
  local r = redis.call('HMGET', prefix .. 'r:' .. run_id, 'ver', 'bg')
  if not r[1] then return {'norun'} end
  redis.call('HSET', hk, hold_id, v)
  redis.call('ZADD', prefix .. 'hr', 0, run_id)
  if r[2] then redis.call('HSET', prefix .. 'bh:' .. r[2], bhold_field(run_id, hold_id), v) end
  return {'ok'}
end

error('agentstate: unknown budgets operation ' .. tostring(op))

-- patch_run: adds amounts to a run and bumps its version (R4, R5), with
-- exact u64 arithmetic; an overflow is refused before anything is written.
--
-- KEYS: 1 run hash
-- ARGV: 1 now, 2..6 messages_read, input_tokens, output_tokens,
--       cost_micros, iterations to add, 7 largest record in bytes,
--       8 tenant key prefix, 9 run id, 10 hold id to settle ('' for a
--       plain patch)
-- Adds the spend to the run's budget and drops expired holds (B3, B5, B6).
local run, now, max = KEYS[1], ARGV[1], tonumber(ARGV[7])
local prefix, run_id, hold_id = ARGV[8], ARGV[9], ARGV[10]
local s = redis.call('HMGET', run, 'v', 'hl', 'hc', 'ver', 'seq', 'ca', 'mr', 'it', 'ot', 'co', 'ir', 'bg')
if not s[1] then return {'notfound'} end
local budget = s[12]
local hold = nil
if hold_id ~= '' then
  local h = redis.call('HGET', prefix .. 'h:' .. run_id, hold_id)
  if not h then return {'nohold'} end
  hold = parse_hold(h)
  if not hold_live(hold, now) then return {'nohold'} end
end
-- In rules::patched_run's order, with its words.
local fields = {
  {'usage.input_tokens', 8, 3}, {'usage.output_tokens', 9, 4}, {'cost_micros', 10, 5},
  {'iterations', 11, 6}, {'messages_read', 7, 2},
}
local new = {}
for _, f in ipairs(fields) do
  local name, at, arg = f[1], f[2], f[3]
  local sum = add_dec(s[at], ARGV[arg])
  if sum == nil then
    return {'invalid', name .. ': adding ' .. ARGV[arg] .. ' to ' .. s[at] .. ' overflows u64'}
  end
  new[at] = sum
end
local ver = add_dec(s[4], '1')
if ver == nil then return {'invalid', 'version: u64 exhausted'} end
local hl = tonumber(s[2])
local head = string.sub(s[1], 1, hl)
local tail = varint(new[7]) .. varint(new[8]) .. varint(new[9]) .. varint(new[10]) .. varint(new[11])
  .. varint(ver) .. varint(s[6]) .. varint(now) .. varint(s[5])
local v = seal(head, s[3], tail)
-- K2: a record past the store's limit is TooLarge.
if #v > max then return {'toolarge', tostring(#v)} end
if budget and redis.call('EXISTS', prefix .. 'b:' .. budget) == 0 then return {'nobudget', budget} end
redis.call('HSET', run, 'v', v, 'ver', ver, 'ua', now,
  'mr', new[7], 'it', new[8], 'ot', new[9], 'co', new[10], 'ir', new[11])
if hold then
  redis.call('HDEL', prefix .. 'h:' .. run_id, hold_id)
  if budget then redis.call('HDEL', prefix .. 'bh:' .. budget, bhold_field(run_id, hold_id)) end
end
spend_on_budget(prefix, budget, ARGV[5], sat_add(ARGV[3], ARGV[4]), ARGV[6])
purge_holds(prefix, run_id, budget, now)
feed_note(prefix .. 'fd', run_member(run_id))
if hold then return {'ok', v, hold[1], hold[2], hold[3], hold[4], hold[5]} end
return {'ok', v}

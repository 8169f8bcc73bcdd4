-- purge: deletes one batch of a tenant's keys (P1), counting the runs,
-- sessions, budgets and holds among them.
--
-- KEYS: the batch's keys, all under the tenant's prefix
-- ARGV: 1 tenant key prefix
local prefix = ARGV[1]
local n = 0
for _, k in ipairs(KEYS) do
  if string.sub(k, 1, #prefix) ~= prefix then error('agentstate: purge of a key of another tenant') end
  local kind = string.match(string.sub(k, #prefix + 1), '^(%a+):')
  if kind == 'r' or kind == 's' or kind == 'b' then
    n = n + 1
  elseif kind == 'h' then
    n = n + redis.call('HLEN', k)
  end
  redis.call('DEL', k)
end
return tostring(n)

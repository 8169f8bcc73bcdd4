-- purge: deletes one batch of a tenant's keys (P1), counting the runs,
-- sessions, budgets and holds among them. The feed's counter and horizon
-- stay (a purged tenant's positions never go back); its feed set goes, and
-- `purged` (feed.lua) then moves the horizon past every position.
--
-- KEYS: the batch's keys, all under the tenant's prefix
-- ARGV: 1 tenant key prefix
local prefix = ARGV[1]
local keep = {[prefix .. 'fd:n'] = true, [prefix .. 'fd:h'] = true}
local n = 0
for _, k in ipairs(KEYS) do
  if string.sub(k, 1, #prefix) ~= prefix then error('agentstate: purge of a key of another tenant') end
  local kind = string.match(string.sub(k, #prefix + 1), '^(%a+):')
  if keep[k] then
    kind = nil
  elseif kind == 'r' or kind == 's' or kind == 'b' then
    n = n + 1
  elseif kind == 'h' then
    n = n + redis.call('HLEN', k)
  end
  if not keep[k] then redis.call('DEL', k) end
end
return tostring(n)

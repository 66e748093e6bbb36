-- budget_set.lua (budgets slot): keep a budget under its id, or remove it; every change moves the version the
-- reserve scripts check, so a reserve that read the budgets before the change reads them again.
-- KEYS: 1 budget definitions  2 the budgets' version
-- ARGV: 1 the budget's id  2 what is kept of it (ledger/budgets.encode_budget), '' to remove it
-- Returns 1 when something changed, else 0.
local kept = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[2] == '' then
  if not kept then return 0 end
  redis.call('HDEL', KEYS[1], ARGV[1])
elseif kept == ARGV[2] then
  return 0
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
redis.call('INCR', KEYS[2])
return 1

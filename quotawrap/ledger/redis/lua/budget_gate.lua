-- budget_gate.lua (Cluster, budgets slot): check the call's budgets and take their share of the hold, between
-- the run gate and the model-day script (which checks every limit again on the counters seen here).
-- KEYS: 1 budget counters  2 budget holds  3 the budgets' version
-- ARGV: 1 the call (reserve_args JSON; its limits are its budgets' alone)  2 the budgets' version they were read at
-- Returns {taken, the budget counters seen (budget_reply's)}; {-1} the budgets changed since they were read.
local a = reserve_args(1)
if (redis.call('GET', KEYS[3]) or '0') ~= ARGV[2] then return {-1} end
local budgets = budget_read(KEYS[1], a.budgets)
local mine = redis.call('HGET', KEYS[2], a.hold_id)
if mine then return {1, budget_reply(a.budgets, budgets)} end  -- a retried reserve: taken before
local taken = 0
if a.enforce == '0' or blocking(a.limits, false, {0, 0, 0, 0}, 0, 0, a.reserve, a.reserve_cost, budgets) == 0 then
  budget_take(KEYS[1], KEYS[2], a)
  taken = 1
end
return {taken, budget_reply(a.budgets, budgets)}

-- budget_apply.lua (Cluster, budgets slot): move a hold's budget copy to the state its model-day reached.
-- KEYS: 1 budget counters  2 budget holds
-- ARGV: 1 hold id  2 target state  3 charged tokens  4 charged cost
-- Returns 1 when the copy moved, 0 when it was gone or already there.
return budget_apply(KEYS[1], KEYS[2], ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]))

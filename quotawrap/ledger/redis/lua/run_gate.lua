-- run_gate.lua (Cluster, run slot): check the run limits and take the run's share of the hold.
-- KEYS: 1 run counters  2 run holds  3 run model-days
-- ARGV: 1 the call (reserve_args JSON)
-- Returns {run settled, run in flight, run cost settled, run cost in flight, taken}.
local run, taken = run_gate(KEYS[1], KEYS[2], KEYS[3], reserve_args(1))
return {run[1], run[2], run[3], run[4], taken}

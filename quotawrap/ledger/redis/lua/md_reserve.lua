-- md_reserve.lua (Cluster, model-day slot): check every limit on the run counters the gate saw, take the hold.
-- KEYS: 1 md counters  2 md open  3 md pids  4 hold  5 md run totals  6 md audit
-- ARGV: 1-4 the run counters the gate saw (settled, in flight, cost settled, cost in flight)
--       5 foreign usage  6 the call (reserve_args JSON)
-- Returns {blocking, md settled, md in flight, held}.
local a = reserve_args(6)
local k = {counters = KEYS[1], open = KEYS[2], pids = KEYS[3], hold = KEYS[4], run_totals = KEYS[5],
  audit = KEYS[6]}
local run = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])}
return md_reserve(k, a, run, tonumber(ARGV[5]))

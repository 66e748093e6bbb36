-- run_apply.lua (Cluster, run slot): move the run's copy of a hold to the state its model-day reached.
-- KEYS: 1 run counters  2 run holds
-- ARGV: 1 hold id  2 target state  3 charged tokens  4 charged cost  5 run TTL seconds
-- Returns 1 when the copy moved, 0 when it was gone or already there.
return run_apply(KEYS[1], KEYS[2], ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5])

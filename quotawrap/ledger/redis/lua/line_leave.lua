-- line_leave.lua: a waiter leaves its lines (it gave up, or on Cluster was admitted in the other slot).
-- KEYS: pairs of (line, line leases), all in one slot on Cluster
-- ARGV: 1 the waiter
-- Returns 0.
for i = 1, #KEYS, 2 do line_leave(KEYS[i], KEYS[i + 1], ARGV[1]) end
return 0

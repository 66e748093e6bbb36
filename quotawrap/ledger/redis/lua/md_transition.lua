-- md_transition.lua (Cluster, model-day slot): settle, release or resolve a hold in its model-day.
-- KEYS: 1 hold  2 md counters  3 md open  4 md pids  5 md run totals  6 md series  7 md audit
-- ARGV: 1 the event (transition_args JSON)
-- Returns {changed, new state, reserved, charged, settled delta, run, charged cost}, or {0}.
local a = transition_args(1)
local k = {hold = KEYS[1], counters = KEYS[2], open = KEYS[3], pids = KEYS[4], run_totals = KEYS[5],
  series = KEYS[6], audit = KEYS[7]}
return md_transition(k, a)

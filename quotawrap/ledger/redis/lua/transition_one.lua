-- transition_one.lua (single node): settle, release or resolve a hold in the model-day and run slots at once,
-- and mirror the settled delta into our LiteLLM daily_usage key.
-- KEYS: 1 hold  2 md counters  3 md open  4 md pids  5 md run totals  6 md series  7 md audit
--       8 run counters  9 run holds  10 our daily_usage key  11 hold location  12 budget counters  13 budget holds
-- ARGV: 1 the event (transition_args JSON)
-- Returns md_transition's {changed, new state, reserved, charged, settled delta, run, charged cost}, or {0}.
return transition_both(KEYS, 0, transition_args(1))

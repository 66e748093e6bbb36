-- transition_one.lua (single node): settle, release or resolve a hold in the model-day and run slots at once,
-- and mirror the settled delta into our LiteLLM daily_usage key.
-- KEYS: 1 hold  2 md counters  3 md open  4 md pids  5 md run totals  6 md series  7 md audit
--       8 run counters  9 run holds  10 our daily_usage key  11 hold location
-- ARGV: 1 the event (transition_args JSON)
-- Returns md_transition's {changed, new state, reserved, charged, settled delta, run, charged cost}, or {0}.
local a = transition_args(1)
local k = {hold = KEYS[1], counters = KEYS[2], open = KEYS[3], pids = KEYS[4], run_totals = KEYS[5],
  series = KEYS[6], audit = KEYS[7]}
local r = md_transition(k, a)
if r[1] == 1 then
  run_apply(KEYS[8], KEYS[9], a.hold_id, r[2], r[4], r[7], a.run_ttl)
  if r[5] ~= 0 then
    redis.call('INCRBY', KEYS[10], int(r[5]))
    redis.call('EXPIRE', KEYS[10], a.own_ttl)
  end
  if r[2] ~= 'unresolved' then redis.call('DEL', KEYS[11]) end
end
return r

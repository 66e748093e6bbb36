-- run_gate.lua (Cluster, run slot): check the run's waiting line and limits, and take the run's share of the hold.
-- KEYS: 1 run counters  2 run holds  3 run model-days  4 run line  5 run line leases
-- ARGV: 1 the call (reserve_args JSON; a call that can wait carries its ticket)
-- A call with waiters ahead in the run line takes nothing (and joins the line if it can wait); a waiter the
-- run limits refuse for holds in flight joins it. The model-day script decides the call with the number ahead.
-- Returns {run settled, run in flight, run cost settled, run cost in flight, taken, waiters ahead in the run line,
-- 1 when the call has a place in the run line (to leave if the model-day admits it)}; {-4, the server's time} the
-- call names another day than the server's (day_refused): it takes nothing.
local a = reserve_args(1)
local now = server_now()
local other_day = day_refused(a, now)
if other_day then return other_day end
local ahead_run, in_line = 0, 0
if a.enforce == '1' then
  local entries = line_read(KEYS[4], KEYS[5], now)
  local waiter, ticket = line_self(a, now, entries)
  ahead_run = line_ahead(entries, waiter, ticket, now)
  local can_wait = a.can_wait == '1' and waiter and ticket
  local run = run_counters(KEYS[1])
  if ahead_run > 0 then
    if can_wait then line_stay(KEYS[4], KEYS[5], waiter, ticket, now + a.lease, true, a.line_ttl) end
    return {run[1], run[2], run[3], run[4], 0, ahead_run, 0}
  end
  if can_wait then
    local crowd_run = line_crowded(a.limits, run, 0, 0, a.reserve, a.reserve_cost)
    local never = never_blocking(a.limits, true, run, 0, a.reserve, a.reserve_cost) ~= 0
    line_stay(KEYS[4], KEYS[5], waiter, ticket, now + a.lease, crowd_run and not never, a.line_ttl)
  end
  if waiter and redis.call('ZSCORE', KEYS[4], waiter) then in_line = 1 end
end
local run, taken = run_gate(KEYS[1], KEYS[2], KEYS[3], a)
return {run[1], run[2], run[3], run[4], taken, ahead_run, in_line}

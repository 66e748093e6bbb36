-- md_reserve.lua (Cluster, model-day slot): check the model-day's waiting line and every limit on the run
-- counters the gate saw, take the hold.
-- KEYS: 1 md counters  2 md open  3 md pids  4 hold  5 md run totals  6 md audit  7 md line  8 md line leases
-- ARGV: 1-4 the run counters the gate saw (settled, in flight, cost settled, cost in flight)
--       5 foreign usage (the LiteLLM limiter's and the unmapped endpoints' settled)  6 the call (reserve_args
--       JSON)  7 waiters ahead in the run line (the gate's count)  8 the unmapped endpoints' tokens in flight
--       (read before this script: another slot); a.budget_seen: the budget counters the budget gate saw
--       (scope, settled, in flight, ... as budget_reply's)
-- Returns {blocking, md settled, md in flight, held, waiters ahead in the md line, the lines' outcome, the server's
-- time}; {-4, the server's time} the call names another day than the server's (day_refused).
local a = reserve_args(6)
local now = server_now()
local other_day = day_refused(a, now)
if other_day then return other_day end
local k = {counters = KEYS[1], open = KEYS[2], pids = KEYS[3], hold = KEYS[4], run_totals = KEYS[5],
  audit = KEYS[6]}
local run = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])}
local foreign = tonumber(ARGV[5])
local unmapped_in_flight = tonumber(ARGV[8] or '0')
local budgets = {}
local seen = a.budget_seen or {}
for i = 1, #seen, 3 do budgets[seen[i]] = {tonumber(seen[i + 1]), tonumber(seen[i + 2])} end
local outcome, ahead_md, waiter = '', 0, false
if a.enforce == '1' then
  local entries = line_read(KEYS[7], KEYS[8], now)
  local ticket
  waiter, ticket = line_self(a, now, entries)
  ahead_md = line_ahead(entries, waiter, ticket, now)
  local md_settled, md_in_flight = counters(KEYS[1])
  local join_run, join_md, refused  -- the gate took care of the run line
  md_settled, md_in_flight = md_settled + foreign, md_in_flight + unmapped_in_flight
  outcome, join_run, join_md, refused =
    line_answer(a, run, md_settled, md_in_flight, tonumber(ARGV[7]), ahead_md, budgets)
  if outcome == 'queued' or outcome == 'wait' then
    line_stay(KEYS[7], KEYS[8], waiter, ticket, now + a.lease, join_md, a.line_ttl)
    return {refused, md_settled, md_in_flight, 0, ahead_md, outcome, time_field(now)}
  end
end
local r = md_reserve(k, a, run, foreign, outcome == 'line_refused', nil, unmapped_in_flight, budgets)
if r[4] == 1 and waiter then line_leave(KEYS[7], KEYS[8], waiter) end
return {r[1], r[2], r[3], r[4], ahead_md, outcome, time_field(now)}

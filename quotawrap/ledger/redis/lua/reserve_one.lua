-- reserve_one.lua (single node): check the waiting lines and every limit, and take the hold in the run and
-- model-day slots at once.
-- KEYS: 1 hold  2 hold location  3 meta  4 our snapshot  5 their balance_at_sync  6 their usage_at_sync
--       7 run counters  8 run holds  9 run model-days
--       10 md counters  11 md open  12 md pids  13 md run totals  14 md audit
--       15 run line  16 run line leases  17 md line  18 md line leases  19 the ticket sequence
--       20 the active model-days index  21 the known models  22 the unmapped endpoints' model-day counters
--       (identity.UNMAPPED's: they count against every model-day, as any of them may be this model)
--       23 budget counters  24 budget holds  25 the budgets' version (ledger/budgets.py)
--       26.. the LiteLLM limiter's daily_usage keys of this model-day
-- ARGV: 1 epoch  2 snapshot fingerprint  3 the call (reserve_args JSON; a.budgets: its budget scopes)
--       4 the budgets' version the call's budgets were read at
-- Returns {blocking, md settled, md in flight, held, run settled, run in flight, foreign, run cost settled,
-- run cost in flight, waiters ahead in the run line, in the md line, the lines' outcome, ticket, the server's time,
-- the budget counters read (budget_reply's)}; {-1} the snapshot or the budgets changed since they were read; {-2} the store lost its data; {-3, at} the day is marked lost;
-- {-4, the server's time} the call names another day than the server's (day_refused).
local a = reserve_args(3)
local meta = redis.call('HMGET', KEYS[3], 'epoch', 'lost:' .. a.day)
if meta[1] ~= ARGV[1] then return {-2} end
if meta[2] then return {-3, meta[2]} end
local now = server_now()
local other_day = day_refused(a, now)
if other_day then return other_day end
local theirs = redis.call('MGET', KEYS[5], KEYS[6])
local fingerprint = (redis.call('HGET', KEYS[4], 'synced_at') or '') .. '|' .. (theirs[1] or '') .. '|'
  .. (theirs[2] or '')
if fingerprint ~= ARGV[2] or (redis.call('GET', KEYS[25]) or '0') ~= ARGV[4] then return {-1} end
if a.index_at ~= '' then  -- once a minute per process: the model-day for reclaim_orphans, the model for known_models
  redis.call('ZADD', KEYS[20], a.index_at, a.day .. '\t' .. a.model)
  redis.call('SADD', KEYS[21], a.model)
end
local foreign = sum_keys(26)
local budgets = budget_read(KEYS[23], a.budgets)
local unmapped_settled, unmapped_in_flight = 0, 0
if KEYS[22] ~= KEYS[10] then unmapped_settled, unmapped_in_flight = counters(KEYS[22]) end
local outcome, ahead_run, ahead_md, waiter, ticket = '', 0, 0, false, false
local seen_run, seen_md = nil, nil  -- the counters as the lines' answer read them: the gate and the hold reuse them
if a.enforce == '1' then
  -- Nearly always both lines are empty (no key): one EXISTS instead of two reads.
  local run_entries, md_entries = {}, {}
  if redis.call('EXISTS', KEYS[15], KEYS[17]) > 0 then
    run_entries, md_entries = line_read(KEYS[15], KEYS[16], now), line_read(KEYS[17], KEYS[18], now)
  end
  waiter, ticket = line_self(a, now, run_entries, md_entries)
  ahead_run, ahead_md = line_ahead(run_entries, waiter, ticket, now), line_ahead(md_entries, waiter, ticket, now)
  if ahead_run + ahead_md > 0 or a.can_wait == '1' then  -- else the lines cannot change the limits' answer
    local run = run_counters(KEYS[7])
    local md_settled, md_in_flight = counters(KEYS[10])
    seen_run, seen_md = run, {md_settled, md_in_flight}
    md_settled, md_in_flight = md_settled + foreign + unmapped_settled, md_in_flight + unmapped_in_flight
    local join_run, join_md, refused
    outcome, join_run, join_md, refused = line_answer(a, run, md_settled, md_in_flight, ahead_run, ahead_md, budgets)
    if outcome == 'queued' or outcome == 'wait' then
      if not ticket then ticket = redis.call('INCR', KEYS[19]) end
      local until_ = now + a.lease
      line_stay(KEYS[15], KEYS[16], waiter, ticket, until_, join_run, a.line_ttl)
      line_stay(KEYS[17], KEYS[18], waiter, ticket, until_, join_md, a.line_ttl)
      return {refused, md_settled, md_in_flight, 0, run[1], run[2], foreign, run[3], run[4], ahead_run, ahead_md,
        outcome, ticket, time_field(now), budget_reply(a.budgets, budgets)}
    end
  end
end
local run, taken = run_gate(KEYS[7], KEYS[8], KEYS[9], a, seen_run)
local k = {counters = KEYS[10], open = KEYS[11], pids = KEYS[12], hold = KEYS[1], run_totals = KEYS[13],
  audit = KEYS[14]}
local r = md_reserve(k, a, run, foreign + unmapped_settled, outcome == 'line_refused', seen_md, unmapped_in_flight,
  budgets)
if r[4] == 1 then
  budget_take(KEYS[23], KEYS[24], a)
  redis.call('SET', KEYS[2], a.day .. '\t' .. a.model .. '\t' .. a.run, 'EXAT', a.expire_at)
  if waiter and ticket then
    line_leave(KEYS[15], KEYS[16], waiter)
    line_leave(KEYS[17], KEYS[18], waiter)
  end
elseif taken == 1 then
  run_apply(KEYS[7], KEYS[8], a.hold_id, 'gone', 0, 0, a.run_ttl)
end
return {r[1], r[2], r[3], r[4], run[1], run[2], foreign, run[3], run[4], ahead_run, ahead_md, outcome, ticket or 0,
  time_field(now), budget_reply(a.budgets, budgets)}

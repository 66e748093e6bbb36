-- lib.lua: the functions every ledger script shares; each script is this library plus a short main.
--
-- Keys are passed to the functions, never read from KEYS here, so the same code runs as one
-- script (single node: every slot at once) or as one script per slot (Cluster).
-- Three rules are mirrored from Python and must stay equal to it (tests/unit/test_ledger_lua.py
-- runs both on generated cases): blocking() is quota.verdict (and, on counters with nothing in
-- flight, quota.never_fits), hold_step()/hold_follow() are ledger/holds.py, line_ahead(),
-- line_crowded() and line_decide() are ledger/lines.py. day_refused() holds the server's time against the bounds of
-- quota.beijing_day that Python sends (keys.day_start). Stored field names are listed in docs/redis.md ("Glossary").

local function num(v)
  if not v then return 0 end
  return tonumber(v) or 0
end

-- integers as Redis wants them ("-0" or "1e+15" are no integers to HINCRBY)
local function int(x)
  return string.format('%d', x)
end

-- a model-day's tokens: settled, in flight
local function counters(key)
  local v = redis.call('HMGET', key, 'settled', 'in_flight')
  return num(v[1]), num(v[2])
end

-- a run's tokens and cost (micro-CNY): {settled, in flight, cost settled, cost in flight}
local function run_counters(key)
  local v = redis.call('HMGET', key, 'settled', 'in_flight', 'cost_settled', 'cost_in_flight')
  return {num(v[1]), num(v[2]), num(v[3]), num(v[4])}
end

-- quota.charge: what a call adds to a scope's counters, its cost where the scope counts money (the run's cost,
-- a money budget: core.budgets.budget_scope leads with 'budget:cny:'), else its tokens
local function charge(scope, reserve, reserve_cost)
  if scope == 'run_cost' or string.sub(scope, 1, 11) == 'budget:cny:' then return reserve_cost end
  return reserve
end

-- a limit's scope as the counters it checks and the amount the call adds to them (quota.Limit.scope);
-- budgets: {scope = {settled, in flight}} of the budget scopes read (nil: none); any other scope has zero counters
local function scope_counters(scope, run, md_settled, md_in_flight, reserve, reserve_cost, budgets)
  if scope == 'run' then
    return run[1], run[2], reserve
  elseif scope == 'run_cost' then
    return run[3], run[4], reserve_cost
  elseif scope == 'model_day' then
    return md_settled, md_in_flight, reserve
  end
  local amount = charge(scope, reserve, reserve_cost)
  local seen = budgets and budgets[scope]
  if seen then return seen[1], seen[2], amount end
  return 0, 0, amount
end

-- quota.verdict: the index of the first limit that refuses the call, 0 when every limit fits.
-- limits: {scope, kind, cap, name} each, already in quota.ordered's order (walls first).
-- Scopes: run (tokens), run_cost (micro-CNY, checked with the call's cost), model_day (tokens);
-- any other scope has zero counters. run_only: check the run scopes alone (the Cluster run gate).
local function blocking(limits, run_only, run, md_settled, md_in_flight, reserve, reserve_cost, budgets)
  for i, limit in ipairs(limits) do
    local scope = limit[1]
    if not run_only or scope == 'run' or scope == 'run_cost' then
      local settled, in_flight, amount =
        scope_counters(scope, run, md_settled, md_in_flight, reserve, reserve_cost, budgets)
      if limit[2] == 'wall' then
        if settled >= limit[3] then return i end
      elseif settled + in_flight + amount > limit[3] then
        return i
      end
    end
  end
  return 0
end

-- quota.never_fits: blocking() on the counters with nothing in flight (what settles first cannot help)
local function never_blocking(limits, run_only, run, md_settled, reserve, reserve_cost, budgets)
  local settled_only = nil
  if budgets then
    settled_only = {}
    for scope, seen in pairs(budgets) do settled_only[scope] = {seen[1], 0} end
  end
  return blocking(limits, run_only, {run[1], 0, run[3], 0}, md_settled, 0, reserve, reserve_cost, settled_only)
end

-- lines.ahead: how many live waiters stand ahead of a call in one line.
-- entries: {{ticket, waiter, until}, ...}; waiter and ticket are false when the call has none.
local function line_ahead(entries, waiter, ticket, now)
  local count = 0
  for _, e in ipairs(entries) do
    if e[3] > now and e[2] ~= waiter then
      if not ticket or not waiter or e[1] < ticket or (e[1] == ticket and e[2] < waiter) then
        count = count + 1
      end
    end
  end
  return count
end

-- lines.crowded: whether a hold limit of the run line, of the model-day line, does not fit now
local function line_crowded(limits, run, md_settled, md_in_flight, reserve, reserve_cost, budgets)
  local crowd_run, crowd_md = false, false
  for _, limit in ipairs(limits) do
    if limit[2] == 'hold' then
      local scope = limit[1]
      local settled, in_flight, amount =
        scope_counters(scope, run, md_settled, md_in_flight, reserve, reserve_cost, budgets)
      if settled + in_flight + amount > limit[3] then
        if scope == 'model_day' then crowd_md = true else crowd_run = true end
      end
    end
  end
  return crowd_run, crowd_md
end

-- lines.decide: take | refuse | queued | wait | line_refused, then whether the call joins the run
-- line, the model-day line.
local function line_decide(ahead_run, ahead_md, allowed, never, crowd_run, crowd_md, can_wait, enforce)
  if not enforce then return 'take', false, false end
  if ahead_run > 0 or ahead_md > 0 then
    if can_wait then return 'queued', ahead_run > 0, ahead_md > 0 end
    return 'line_refused', false, false
  end
  if allowed then return 'take', false, false end
  if can_wait and not never then return 'wait', crowd_run, crowd_md end
  return 'refuse', false, false
end

-- A line is a sorted set (score: ticket, member: waiter) and a hash of leases (waiter -> until, in
-- the server's clock). Read as line_ahead's entries; places whose lease ran out are dropped.
local function line_read(line, leases, now)
  local flat = redis.call('ZRANGE', line, 0, -1, 'WITHSCORES')
  local entries = {}
  if #flat == 0 then return entries end
  local waiters = {}
  for i = 1, #flat, 2 do waiters[#waiters + 1] = flat[i] end
  local untils = redis.call('HMGET', leases, unpack(waiters))
  for i, w in ipairs(waiters) do
    local until_ = tonumber(untils[i]) or 0
    if until_ <= now then
      redis.call('ZREM', line, w)
      redis.call('HDEL', leases, w)
    end
    entries[i] = {tonumber(flat[2 * i]), w, until_}
  end
  return entries
end

-- The server's clock in seconds: every lease of a line is written and read on its own node.
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- The server's time as a reply field (a Lua number would reach the client cut to an integer).
local function time_field(now)
  return string.format('%.6f', now)
end

-- A reserve opens its day's counters only on the server's day, whatever the clock of the host that sends it:
-- a.day_start is the Unix time of the Beijing midnight that starts a.day (keys.day_start; false on a ledger
-- given a simulated clock). The reply for another day: {-4, the server's time}, which the client asks again with.
local function day_refused(a, now)
  if a.day_start and (now < a.day_start or now >= a.day_start + 86400) then return {-4, time_field(now)} end
  return nil
end

-- The call's waiter id and ticket from its reserve_args (false when it has none); a ticket it
-- already holds in one of the lines read wins over none.
local function line_self(a, now, ...)
  local waiter, ticket = false, false
  if a.waiter ~= '' then waiter = a.waiter end
  if a.ticket > 0 then ticket = a.ticket end
  if waiter and not ticket then
    for _, entries in ipairs({...}) do
      for _, e in ipairs(entries) do
        if e[2] == waiter and e[3] > now and not ticket then ticket = e[1] end
      end
    end
  end
  return waiter, ticket
end

-- Renew the call's lease where it has a place, and take a place in the line when join is set.
local function line_stay(line, leases, waiter, ticket, until_, join, ttl)
  if join then
    redis.call('ZADD', line, 'NX', int(ticket), waiter)
  elseif not redis.call('ZSCORE', line, waiter) then
    return
  end
  redis.call('HSET', leases, waiter, until_)
  redis.call('EXPIRE', line, ttl)
  redis.call('EXPIRE', leases, ttl)
end

local function line_leave(line, leases, waiter)
  redis.call('ZREM', line, waiter)
  redis.call('HDEL', leases, waiter)
end

-- The lines' answer for a call (lines.decide on the ledger's counters, foreign usage included in
-- md_settled); ahead_run, ahead_md: line_ahead of each line (on Cluster the run gate's, passed on).
-- Returns line_decide's three answers, then blocking()'s.
local function line_answer(a, run, md_settled, md_in_flight, ahead_run, ahead_md, budgets)
  local refused = blocking(a.limits, false, run, md_settled, md_in_flight, a.reserve, a.reserve_cost, budgets)
  local never = never_blocking(a.limits, false, run, md_settled, a.reserve, a.reserve_cost, budgets) ~= 0
  local crowd_run, crowd_md =
    line_crowded(a.limits, run, md_settled, md_in_flight, a.reserve, a.reserve_cost, budgets)
  local outcome, join_run, join_md = line_decide(ahead_run, ahead_md, refused == 0, never, crowd_run, crowd_md,
    a.can_wait == '1' and a.waiter ~= '', a.enforce == '1')
  return outcome, join_run, join_md, refused
end

-- holds.MAX_CHARGE and holds.clamp: an amount within 0..2^53-1, so no counter wraps or goes negative
local MAX_CHARGE = 9007199254740991

local function clamp(amount)
  if amount < 0 then return 0 end
  if amount > MAX_CHARGE then return MAX_CHARGE end
  return amount
end

-- holds.RANK: a transition must move a hold strictly forward
local RANK = {held = 0, unresolved = 1, settled = 2, released = 2, gone = 2}

-- holds.follow: the counter deltas that move a hold from state to target, nil when not forward.
-- Returns settled, in flight, cost settled, cost in flight (several values: no table per call).
local function hold_follow(state, reserved, charged, reserved_cost, charged_cost, target, new_charged,
                           new_charged_cost)
  if RANK[state] == nil or RANK[target] <= RANK[state] then return nil end
  local in_flight, cost_in_flight = 0, 0
  if state == 'held' then in_flight, cost_in_flight = 0 - reserved, 0 - reserved_cost end
  return new_charged - charged, in_flight, new_charged_cost - charged_cost, cost_in_flight
end

-- holds.step: event settle | release | resolve; usage_total and cost are nil when unknown.
-- Returns the new state, charged, charged cost, overshoot, then hold_follow's four deltas, then
-- whether the usage or cost was clamped; nil when nothing changes.
local function hold_step(state, event, reserved, charged, reserved_cost, charged_cost, usage_total, cost)
  local target, actual, actual_cost
  if event == 'settle' then
    if not (state == 'held' or (state == 'unresolved' and usage_total ~= nil)) then return nil end
    if usage_total == nil then
      target, actual, actual_cost = 'unresolved', reserved, reserved_cost
    else
      target, actual, actual_cost = 'settled', clamp(usage_total), reserved_cost
      if cost ~= nil then actual_cost = clamp(cost) end
    end
  elseif state ~= 'held' then
    return nil
  elseif event == 'release' then
    target, actual, actual_cost = 'released', 0, 0
  else
    target, actual, actual_cost = 'unresolved', reserved, reserved_cost
  end
  local settled, in_flight, cost_settled, cost_in_flight =
    hold_follow(state, reserved, charged, reserved_cost, charged_cost, target, actual, actual_cost)
  if settled == nil then return nil end
  local clamped = target == 'settled' and (actual ~= usage_total or (cost ~= nil and actual_cost ~= cost))
  return target, actual, actual_cost, (target == 'settled' and actual > reserved), settled, in_flight,
    cost_settled, cost_in_flight, clamped
end

-- the sum of the string keys KEYS[first..], in one MGET
local function sum_keys(first)
  if #KEYS < first then return 0 end
  local total = 0
  for _, v in ipairs(redis.call('MGET', unpack(KEYS, first))) do total = total + num(v) end
  return total
end

local function expire_all(keys, at)
  for _, k in ipairs(keys) do redis.call('EXPIREAT', k, at) end
end

-- A batch's counter writes (transition_many), made once per key and field when it ends instead of once per
-- hold: HINCRBYs summed per field, INCRBYs per key, each key's last TTL, the usage series' points. A batch of
-- settles is one script, so nothing sees the counters between two of its holds; w nil: written at once.
local function batch_writes()
  return {incr = {}, keys = {}, strings = {}, string_keys = {}, ttl = {}, ttl_keys = {}, pids = {}, points = {}}
end

local function hincr(w, key, field, delta)
  if not w then return redis.call('HINCRBY', key, field, int(delta)) end
  local fields = w.incr[key]
  if not fields then
    fields = {}
    w.incr[key] = fields
    w.keys[#w.keys + 1] = key
  end
  fields[field] = (fields[field] or 0) + delta
  return fields[field]
end

local function incr(w, key, delta)
  if not w then return redis.call('INCRBY', key, int(delta)) end
  if not w.strings[key] then w.string_keys[#w.string_keys + 1] = key end
  w.strings[key] = (w.strings[key] or 0) + delta
end

-- command: EXPIRE (seconds) or EXPIREAT (a time); a key's last one stands, as when written at once
local function set_ttl(w, command, key, value)
  if not w then return redis.call(command, key, value) end
  if not w.ttl[key] then w.ttl_keys[#w.ttl_keys + 1] = key end
  w.ttl[key] = {command, value}
end

-- One hold less of an owner (host|pid) in a model-day's pids hash; the field goes at zero.
local function pids_leave(w, key, owner)
  if not w then
    if redis.call('HINCRBY', key, owner, -1) <= 0 then redis.call('HDEL', key, owner) end
    return
  end
  w.pids[key] = true
  hincr(w, key, owner, -1)
end

-- The batch's writes, in the order written at once would leave them: counters, then the series points read
-- from them, then the TTLs (a key that an increment creates gets its TTL).
local function flush_writes(w)
  for _, key in ipairs(w.keys) do
    for field, delta in pairs(w.incr[key]) do
      local now = redis.call('HINCRBY', key, field, int(delta))
      if w.pids[key] and now <= 0 then redis.call('HDEL', key, field) end
    end
  end
  for _, key in ipairs(w.string_keys) do redis.call('INCRBY', key, int(w.strings[key])) end
  local finals = {}
  for _, p in ipairs(w.points) do
    local final = finals[p.counters]
    if not final then
      final = num(redis.call('HGET', p.counters, 'settled'))
      finals[p.counters] = final
    end
    -- the model-day's settled total right after this hold's settle: the final one less what came after it
    redis.call('HSET', p.series, p.minute, int(final - w.incr[p.counters].settled + p.upto + p.foreign))
  end
  for _, key in ipairs(w.ttl_keys) do redis.call(w.ttl[key][1], key, w.ttl[key][2]) end
end

-- The run slot's copy of a hold (a field of the run's holds hash), tab separated:
-- state, reserved, charged, reserved cost, charged cost, day, model (records.parse_run_hold reads it).
local function run_hold(state, reserved, charged, reserved_cost, charged_cost, day, model)
  return table.concat({state, int(reserved), int(charged), int(reserved_cost), int(charged_cost), day, model}, '\t')
end

local function parse_run_hold(text)
  local state, reserved, charged, reserved_cost, charged_cost, day, model =
    string.match(text, '^([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t(.*)$')
  return state, tonumber(reserved), tonumber(charged), tonumber(reserved_cost), tonumber(charged_cost), day, model
end

-- Check the run limits and take the run's share of the hold. Returns (run counters before, taken).
-- seen (optional): the run counters as this script already read them (run_counters' table).
local function run_gate(run_counters_key, run_holds_key, run_model_days_key, a, seen)
  local run = seen or run_counters(run_counters_key)
  local mine = redis.call('HGET', run_holds_key, a.hold_id)
  if mine then  -- a retried reserve: report the counters as they were before it
    local _, reserved, _, reserved_cost = parse_run_hold(mine)
    return {run[1], run[2] - reserved, run[3], run[4] - reserved_cost}, 1
  end
  local taken = 0
  if a.enforce == '0' or blocking(a.limits, true, run, 0, 0, a.reserve, a.reserve_cost) == 0 then
    redis.call('HINCRBY', run_counters_key, 'in_flight', int(a.reserve))
    if a.reserve_cost ~= 0 then redis.call('HINCRBY', run_counters_key, 'cost_in_flight', int(a.reserve_cost)) end
    redis.call('HSET', run_holds_key, a.hold_id, run_hold('held', a.reserve, 0, a.reserve_cost, 0, a.day, a.model))
    taken = 1
  end
  redis.call('SADD', run_model_days_key, a.day .. '\t' .. a.model)
  for _, k in ipairs({run_counters_key, run_holds_key, run_model_days_key}) do redis.call('EXPIRE', k, a.run_ttl) end
  return run, taken
end

-- Move the run slot's copy of a hold to target, charged new_charged tokens and new_charged_cost.
-- State based (hold_follow), so applying a move twice, or two moves out of order, converges.
local function run_apply(run_counters_key, run_holds_key, hold_id, target, new_charged, new_charged_cost, run_ttl, w)
  local copy = redis.call('HGET', run_holds_key, hold_id)
  if not copy then return 0 end
  local state, reserved, charged, reserved_cost, charged_cost, day, model = parse_run_hold(copy)
  local settled, in_flight, cost_settled, cost_in_flight =
    hold_follow(state, reserved, charged, reserved_cost, charged_cost, target, new_charged, new_charged_cost)
  if settled == nil then return 0 end
  if in_flight ~= 0 then hincr(w, run_counters_key, 'in_flight', in_flight) end
  if cost_in_flight ~= 0 then hincr(w, run_counters_key, 'cost_in_flight', cost_in_flight) end
  if settled ~= 0 then hincr(w, run_counters_key, 'settled', settled) end
  if cost_settled ~= 0 then hincr(w, run_counters_key, 'cost_settled', cost_settled) end
  if target == 'unresolved' then
    redis.call('HSET', run_holds_key, hold_id,
      run_hold('unresolved', reserved, new_charged, reserved_cost, new_charged_cost, day, model))
  else
    redis.call('HDEL', run_holds_key, hold_id)
  end
  set_ttl(w, 'EXPIRE', run_counters_key, run_ttl)
  return 1
end

-- Check every limit and take the model-day's share of the hold.
-- k: counters open pids hold run_totals audit. run: the run counters the gate saw; foreign: usage of this
-- model-day counted besides our own (the LiteLLM limiter's, the unmapped endpoints'); line_refused: refuse
-- it for the waiting line (blocking -1). seen (optional): {settled, in flight} of k.counters as this script
-- already read them. also_in_flight (optional): tokens held besides our own (the unmapped endpoints').
-- budgets (optional): the counters of the call's budget scopes (budget_read's).
-- Returns {blocking, settled seen, in flight seen, held}.
local function md_reserve(k, a, run, foreign, line_refused, seen, also_in_flight, budgets)
  local md_settled, md_in_flight
  if seen then md_settled, md_in_flight = seen[1], seen[2] else md_settled, md_in_flight = counters(k.counters) end
  md_settled, md_in_flight = md_settled + foreign, md_in_flight + (also_in_flight or 0)
  local prior = redis.call('HMGET', k.hold, 'state', 'blocking', 'reserved')
  if prior[1] then  -- a retried reserve: the same answer again
    local held = (prior[1] == 'blocked') and 0 or 1
    return {tonumber(prior[2]), md_settled, md_in_flight - held * num(prior[3]), held}
  end
  local refused_by = blocking(a.limits, false, run, md_settled, md_in_flight, a.reserve, a.reserve_cost, budgets)
  if line_refused then refused_by = -1 end
  local held = (refused_by == 0 or a.enforce == '0')
  local advance = a.advance == '1'  -- room ahead for a process's next calls (quotawrap.advances), no call itself
  if advance and not held then return {refused_by, md_settled, md_in_flight, 0} end  -- refused: no trace at all
  local blocked_by, would_block = '', 0
  if refused_by > 0 then blocked_by, would_block = a.limits[refused_by][4], 1 end
  if refused_by < 0 then blocked_by, would_block = 'waiting_line', 1 end
  if held then
    redis.call('HINCRBY', k.counters, 'in_flight', int(a.reserve))
    redis.call('HSET', k.hold, 'state', 'held', 'run', a.run, 'reserved', int(a.reserve), 'charged', 0,
      'reserved_cost', int(a.reserve_cost), 'charged_cost', 0, 'pid', a.pid, 'host', a.host,
      'expires', a.expires, 'started', a.now, 'endpoint', a.endpoint, 'kf', a.key_fingerprint, 'tags', a.tags,
      'blocking', refused_by, 'blocked_by', blocked_by, 'would_block', would_block)
    redis.call('EXPIREAT', k.hold, a.expire_at)
    redis.call('ZADD', k.open, a.expires, a.hold_id)
    redis.call('HINCRBY', k.pids, a.host .. '|' .. a.pid, 1)
    if advance then  -- its calls count as they are split from it
      redis.call('HSET', k.hold, 'advance', 1)
    else
      redis.call('HINCRBY', k.run_totals, 'calls', 1)
    end
    redis.call('HINCRBY', k.run_totals, 'reserved_open_tokens', int(a.reserve))
  else
    redis.call('HSET', k.hold, 'state', 'blocked', 'blocking', refused_by, 'reserved', int(a.reserve))
    redis.call('EXPIRE', k.hold, a.blocked_ttl)
    redis.call('HINCRBY', k.run_totals, 'blocked_calls', 1)
    redis.call('XADD', k.audit, 'MAXLEN', '~', a.audit_max, '*', 'id', a.hold_id, 'run', a.run,
      'state', 'blocked', 'endpoint', a.endpoint, 'reserved', int(a.reserve), 'charged', 0,
      'reserved_cost', int(a.reserve_cost), 'charged_cost', 0, 'prompt', '', 'completion', '',
      'reasoning', '', 'cached', '', 'overshoot', 0, 'would_block', 1, 'blocked_by', blocked_by,
      'kf', a.key_fingerprint, 'tags', a.tags, 'started', a.now, 'ended', '', 'latency', '', 'pid', a.pid,
      'host', a.host)
  end
  if refused_by ~= 0 then redis.call('HINCRBY', k.run_totals, 'would_block_calls', 1) end
  expire_all({k.counters, k.open, k.pids, k.run_totals, k.audit}, a.expire_at)
  return {refused_by, md_settled, md_in_flight, held and 1 or 0}
end

-- Apply a.mode (settle | release | resolve: holds.step's event) to a model-day's hold.
-- a.anomaly (optional): why the answer's usage was not believed; the call counts in anomalous_calls
-- while it stays charged its hold. a.handed_to (optional, on release): a video task took the hold
-- over, so the create is no call of its own (its task's row is).
-- k: hold counters open pids run_totals series audit.
-- w (optional): the batch's writes (batch_writes), made when it ends.
-- Returns {changed, new state, reserved, charged, settled delta, run, charged cost}, or {0}.
local function md_transition(k, a, w)
  local f = redis.call('HMGET', k.hold, 'state', 'reserved', 'charged', 'run', 'pid', 'host', 'endpoint',
    'started', 'reserved_cost', 'charged_cost', 'kf', 'tags', 'would_block', 'blocked_by', 'anomaly', 'advance')
  local state = f[1]
  local advance = f[16] == '1'
  if not state then return {0} end
  local reserved, charged, reserved_cost, charged_cost = num(f[2]), num(f[3]), num(f[9]), num(f[10])
  local usage_total, cost = nil, nil
  if a.has_usage == '1' then
    usage_total = tonumber(a.total)
    if a.cost ~= '' then cost = tonumber(a.cost) end
  end
  local target, actual, actual_cost, overshot, settled_delta, in_flight_delta, cost_delta =
    hold_step(state, a.mode, reserved, charged, reserved_cost, charged_cost, usage_total, cost)
  if target == nil then return {0} end
  local upto = nil  -- the model-day's settled delta so far in the batch (w), this hold's included
  if settled_delta ~= 0 then upto = hincr(w, k.counters, 'settled', settled_delta) end
  if in_flight_delta ~= 0 then hincr(w, k.counters, 'in_flight', in_flight_delta) end
  if state == 'held' then
    redis.call('ZREM', k.open, a.hold_id)
    pids_leave(w, k.pids, f[6] .. '|' .. f[5])
    hincr(w, k.run_totals, 'reserved_open_tokens', 0 - reserved)
  else
    hincr(w, k.run_totals, 'unresolved_calls', -1)
    if f[15] then hincr(w, k.run_totals, 'anomalous_calls', -1) end
  end
  local anomaly, handed_to = a.anomaly or '', a.handed_to or ''
  if anomaly ~= '' then hincr(w, k.run_totals, 'anomalous_calls', 1) end
  if settled_delta ~= 0 then hincr(w, k.run_totals, 'settled_tokens', settled_delta) end
  if cost_delta ~= 0 then hincr(w, k.run_totals, 'settled_cost', cost_delta) end
  if target == 'unresolved' then
    hincr(w, k.run_totals, 'unresolved_calls', 1)
  elseif target == 'released' and handed_to ~= '' then
    hincr(w, k.run_totals, 'calls', -1)
  elseif target == 'released' and not advance then
    hincr(w, k.run_totals, 'released_calls', 1)
  end
  if advance and target == 'unresolved' then hincr(w, k.run_totals, 'calls', 1) end  -- charged whole: a call now
  local prompt, completion, reasoning, cached, overshoot = '', '', '', '', 0
  if target == 'settled' then
    prompt, completion, reasoning, cached = a.prompt, a.completion, a.reasoning, a.cached
    hincr(w, k.run_totals, 'prompt_tokens', tonumber(prompt))
    hincr(w, k.run_totals, 'completion_tokens', tonumber(completion))
    hincr(w, k.run_totals, 'reasoning_tokens', tonumber(reasoning))
    hincr(w, k.run_totals, 'cached_tokens', tonumber(cached))
    if overshot then
      overshoot = 1
      hincr(w, k.run_totals, 'overshoot_calls', 1)
    end
  end
  if settled_delta ~= 0 and w then
    w.points[#w.points + 1] = {series = k.series, counters = k.counters, minute = a.minute, upto = upto,
      foreign = tonumber(a.foreign)}
  elseif settled_delta ~= 0 then
    local cumulative = num(redis.call('HGET', k.counters, 'settled')) + tonumber(a.foreign)
    redis.call('HSET', k.series, a.minute, int(cumulative))
  end
  if target == 'unresolved' then
    redis.call('HSET', k.hold, 'state', 'unresolved', 'charged', int(actual), 'charged_cost', int(actual_cost))
    if anomaly ~= '' then redis.call('HSET', k.hold, 'anomaly', anomaly) end
  else
    redis.call('DEL', k.hold)
  end
  if not (advance and target == 'released') then  -- an advance given back was never a call: no record of it
    redis.call('XADD', k.audit, 'MAXLEN', '~', a.audit_max, '*', 'id', a.hold_id, 'run', f[4],
      'state', target, 'endpoint', f[7], 'reserved', int(reserved), 'charged', int(actual),
      'reserved_cost', int(reserved_cost), 'charged_cost', int(actual_cost), 'prompt', prompt,
      'completion', completion, 'reasoning', reasoning, 'cached', cached, 'overshoot', overshoot,
      'would_block', f[13] or 0, 'blocked_by', f[14] or '', 'kf', f[11] or '', 'tags', f[12] or '',
      'started', f[8] or a.now, 'ended', a.now, 'latency', a.latency, 'pid', f[5] or 0, 'host', f[6] or '',
      'anomaly', anomaly, 'handed_to', handed_to)
  end
  for _, key in ipairs({k.counters, k.run_totals, k.series, k.audit}) do set_ttl(w, 'EXPIREAT', key, a.expire_at) end
  return {1, target, reserved, actual, settled_delta, f[4], actual_cost}
end

-- Budgets (ledger/budgets.py). Their slot holds a hash of counters, fields 's:' .. scope (settled) and 'f:' ..
-- scope (in flight), and a hash of the holds' copies, as the run slot's (run_hold): hold id -> state, reserved,
-- charged, reserved cost, charged cost, then the budget scopes the hold counts against, tab separated.

-- {scope = {settled, in flight}} of the call's budget scopes (a.budgets), read from the counters hash
local function budget_read(counters_key, scopes)
  local found = {}
  if #scopes == 0 then return found end
  local fields = {}
  for i, scope in ipairs(scopes) do
    fields[2 * i - 1], fields[2 * i] = 's:' .. scope, 'f:' .. scope
  end
  local v = redis.call('HMGET', counters_key, unpack(fields))
  for i, scope in ipairs(scopes) do found[scope] = {num(v[2 * i - 1]), num(v[2 * i])} end
  return found
end

-- The counters read, flat for the reply: scope, settled, in flight, ... (cjson would round large numbers)
local function budget_reply(scopes, found)
  local flat = {}
  for _, scope in ipairs(scopes) do
    local seen = found[scope] or {0, 0}
    flat[#flat + 1], flat[#flat + 2], flat[#flat + 3] = scope, int(seen[1]), int(seen[2])
  end
  return flat
end

-- The hold counts against its budget scopes: what it reserved is in flight there, and its copy remembers them.
local function budget_take(counters_key, holds_key, a)
  if #a.budgets == 0 then return end
  for _, scope in ipairs(a.budgets) do
    local amount = charge(scope, a.reserve, a.reserve_cost)
    if amount ~= 0 then redis.call('HINCRBY', counters_key, 'f:' .. scope, int(amount)) end
  end
  local copy = {'held', int(a.reserve), 0, int(a.reserve_cost), 0}
  for _, scope in ipairs(a.budgets) do copy[#copy + 1] = scope end
  redis.call('HSET', holds_key, a.hold_id, table.concat(copy, '\t'))
end

-- Move a hold's budget copy to target, charged new_charged tokens and new_charged_cost (holds.follow, as
-- run_apply moves the run's copy): state based, so a move applied twice, or two out of order, converge.
local function budget_apply(counters_key, holds_key, hold_id, target, new_charged, new_charged_cost, w)
  local copy = redis.call('HGET', holds_key, hold_id)
  if not copy then return 0 end
  local f = {}
  for part in string.gmatch(copy, '[^\t]+') do f[#f + 1] = part end
  local state, reserved, charged, reserved_cost, charged_cost =
    f[1], tonumber(f[2]), tonumber(f[3]), tonumber(f[4]), tonumber(f[5])
  local settled, in_flight, cost_settled, cost_in_flight =
    hold_follow(state, reserved, charged, reserved_cost, charged_cost, target, new_charged, new_charged_cost)
  if settled == nil then return 0 end
  for i = 6, #f do
    local scope = f[i]
    local s, fl = settled, in_flight
    if charge(scope, 0, 1) == 1 then s, fl = cost_settled, cost_in_flight end
    if s ~= 0 then hincr(w, counters_key, 's:' .. scope, s) end
    if fl ~= 0 then hincr(w, counters_key, 'f:' .. scope, fl) end
  end
  if target == 'unresolved' then
    f[1], f[3], f[5] = 'unresolved', int(new_charged), int(new_charged_cost)
    redis.call('HSET', holds_key, hold_id, table.concat(f, '\t'))
  else
    redis.call('HDEL', holds_key, hold_id)
  end
  return 1
end

-- The call's fields come as one JSON argument: packing one string costs the client far less
-- than packing twenty (redis-py's per-argument encoding is the hot spot of a reserve).
local function reserve_args(first)
  local a = cjson.decode(ARGV[first])
  local limits = {}
  for i, l in ipairs(a.limits) do limits[i] = {l[1], l[2], tonumber(l[3]), l[4]} end
  a.limits = limits
  if not a.budgets then a.budgets = {} end
  return a
end

local function transition_args(first)
  return cjson.decode(ARGV[first])
end

-- Single node: settle, release or resolve one hold in the model-day and run slots at once, and
-- mirror the settled delta into our LiteLLM daily_usage key. keys[first + 1 .. first + 13]:
-- hold, md counters, md open, md pids, md run totals, md series, md audit, run counters, run holds,
-- our daily_usage key, hold location, budget counters, budget holds (keys.transition_one). Returns md_transition's
-- reply.
local function transition_both(keys, first, a, w)
  local k = {hold = keys[first + 1], counters = keys[first + 2], open = keys[first + 3], pids = keys[first + 4],
    run_totals = keys[first + 5], series = keys[first + 6], audit = keys[first + 7]}
  local r = md_transition(k, a, w)
  if r[1] == 1 then
    run_apply(keys[first + 8], keys[first + 9], a.hold_id, r[2], r[4], r[7], a.run_ttl, w)
    if r[5] ~= 0 then
      incr(w, keys[first + 10], r[5])
      set_ttl(w, 'EXPIRE', keys[first + 10], a.own_ttl)
    end
    if r[2] ~= 'unresolved' then redis.call('DEL', keys[first + 11]) end
    budget_apply(keys[first + 12], keys[first + 13], a.hold_id, r[2], r[4], r[7], w)
  end
  return r
end

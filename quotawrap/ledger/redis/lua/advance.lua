-- advance.lua: an advance's steps (quotawrap.advances), after lib.lua in the scripts that land them. They mirror
-- ledger/sqlite/advances.py's split_from_advance and close_advance: an advance is a hold (its hash reads
-- advance = 1) whose calls are split from it as their settles land, each into a hold of its own, and whose
-- rest its process gives back once. tests/unit/test_advances.py runs both ledgers on the same generated orders.
--
-- k: advance (its hold), advance_location, hold (the call's), location (the call's), counters, open, pids,
-- run_totals, run_counters, run_holds (the run's copies of holds); w: the batch's writes (lib.lua's batch_writes).

-- The advance gives up reserved tokens and reserved_cost: its hash and its run copy hold that much less.
-- Returns the day and model its run copy names (nil without one).
local function advance_give_up(k, advance_id, reserved, reserved_cost)
  redis.call('HINCRBY', k.advance, 'reserved', int(0 - reserved))
  redis.call('HINCRBY', k.advance, 'reserved_cost', int(0 - reserved_cost))
  local copy = redis.call('HGET', k.run_holds, advance_id)
  if not copy then return nil, nil end
  local state, held, charged, held_cost, charged_cost, day, model = parse_run_hold(copy)
  redis.call('HSET', k.run_holds, advance_id,
    run_hold(state, held - reserved, charged, held_cost - reserved_cost, charged_cost, day, model))
  return day, model
end

-- What no hold holds any more leaves the counters in flight (the model-day's, the run's, its open total).
local function out_of_flight(k, reserved, reserved_cost, w)
  if reserved ~= 0 then
    hincr(w, k.counters, 'in_flight', 0 - reserved)
    hincr(w, k.run_counters, 'in_flight', 0 - reserved)
    hincr(w, k.run_totals, 'reserved_open_tokens', 0 - reserved)
  end
  if reserved_cost ~= 0 then hincr(w, k.run_counters, 'cost_in_flight', 0 - reserved_cost) end
end

-- An advance whose room is all drawn and settled, or given back, is gone: it was never a call (no record).
local function gone_if_empty(k, advance_id, w)
  local f = redis.call('HMGET', k.advance, 'reserved', 'reserved_cost', 'host', 'pid')
  local reserved, reserved_cost = num(f[1]), num(f[2])
  if reserved > 0 or reserved_cost > 0 then return end
  out_of_flight(k, reserved, reserved_cost, w)  -- what it still held (none: a call drew no more than was left)
  redis.call('ZREM', k.open, advance_id)
  pids_leave(w, k.pids, f[3] .. '|' .. f[4])
  redis.call('HDEL', k.run_holds, advance_id)
  redis.call('DEL', k.advance, k.advance_location)
end

-- The call a.hold_id drawn from the advance d.advance_id gets a hold of its own, which the advance gives up:
-- in flight is unchanged. Once: not when the call was split before (its hold is there, or its mark on the
-- advance), nor once the advance is gone or charged whole (its process died: the call was charged with it).
-- d: the Drawn (advance_id, reserved, reserved_cost, endpoint, kf, started, expires, expire_at: the hold's TTL).
local function split_advance(k, a, d, w)
  local f = redis.call('HMGET', k.advance, 'state', 'advance', 'run', 'pid', 'host', 'tags')
  if f[1] ~= 'held' or f[2] ~= '1' or redis.call('EXISTS', k.hold) == 1 then return 0 end
  if redis.call('HSETNX', k.advance, 'split:' .. a.hold_id, 1) == 0 then return 0 end  -- split and settled before
  local reserved, reserved_cost = clamp(tonumber(d.reserved)), clamp(tonumber(d.reserved_cost))
  local day, model = advance_give_up(k, d.advance_id, reserved, reserved_cost)
  redis.call('HSET', k.hold, 'state', 'held', 'run', f[3], 'reserved', int(reserved), 'charged', 0,
    'reserved_cost', int(reserved_cost), 'charged_cost', 0, 'pid', f[4], 'host', f[5], 'expires', d.expires,
    'started', d.started, 'endpoint', d.endpoint, 'kf', d.kf, 'tags', f[6] or '', 'blocking', 0,
    'blocked_by', '', 'would_block', 0)
  redis.call('EXPIREAT', k.hold, d.expire_at)
  redis.call('ZADD', k.open, d.expires, a.hold_id)
  hincr(w, k.pids, f[5] .. '|' .. f[4], 1)
  hincr(w, k.run_totals, 'calls', 1)
  if day then
    redis.call('HSET', k.run_holds, a.hold_id, run_hold('held', reserved, 0, reserved_cost, 0, day, model))
  end
  local location = redis.call('GET', k.advance_location)
  if location then redis.call('SET', k.location, location, 'EXAT', d.expire_at) end
  gone_if_empty(k, d.advance_id, w)
  return 1
end

-- The advance a.hold_id's process gives back what it did not draw (d.reserved, d.reserved_cost): once, and it
-- then reads closed (its calls drawn and in flight are still split from it as their settles land).
local function close_advance(k, a, d, w)
  local f = redis.call('HMGET', k.advance, 'state', 'advance', 'closed')
  if f[1] ~= 'held' or f[2] ~= '1' or f[3] then return 0 end
  local reserved, reserved_cost = clamp(tonumber(d.reserved)), clamp(tonumber(d.reserved_cost))
  redis.call('HSET', k.advance, 'closed', 1, 'endpoint', d.endpoint)
  advance_give_up(k, a.hold_id, reserved, reserved_cost)
  out_of_flight(k, reserved, reserved_cost, w)
  gone_if_empty(k, a.hold_id, w)
  return 1
end

-- transition_one's keys at keys[first + 1 .. first + 13] and the advance's two after them, as k.
local function advance_keys(keys, first)
  return {hold = keys[first + 1], counters = keys[first + 2], open = keys[first + 3], pids = keys[first + 4],
    run_totals = keys[first + 5], run_counters = keys[first + 8], run_holds = keys[first + 9],
    location = keys[first + 11], advance = keys[first + 14], advance_location = keys[first + 15]}
end

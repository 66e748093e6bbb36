-- reserve_one.lua (single node): check every limit and take the hold in the run and model-day slots at once.
-- KEYS: 1 hold  2 hold location  3 meta  4 our snapshot  5 their balance_at_sync  6 their usage_at_sync
--       7 run counters  8 run holds  9 run model-days
--       10 md counters  11 md open  12 md pids  13 md run totals  14 md audit
--       15.. the LiteLLM limiter's daily_usage keys of this model-day
-- ARGV: 1 epoch  2 snapshot fingerprint  3 the call (reserve_args JSON)
-- Returns {blocking, md settled, md in flight, held, run settled, run in flight, foreign, run cost settled,
-- run cost in flight}; {-1} the snapshot changed since it was read; {-2} the store lost its data;
-- {-3, at} the day is marked lost.
local a = reserve_args(3)
local meta = redis.call('HMGET', KEYS[3], 'epoch', 'lost:' .. a.day)
if meta[1] ~= ARGV[1] then return {-2} end
if meta[2] then return {-3, meta[2]} end
local theirs = redis.call('MGET', KEYS[5], KEYS[6])
local fingerprint = (redis.call('HGET', KEYS[4], 'synced_at') or '') .. '|' .. (theirs[1] or '') .. '|'
  .. (theirs[2] or '')
if fingerprint ~= ARGV[2] then return {-1} end
local run, taken = run_gate(KEYS[7], KEYS[8], KEYS[9], a)
local k = {counters = KEYS[10], open = KEYS[11], pids = KEYS[12], hold = KEYS[1], run_totals = KEYS[13],
  audit = KEYS[14]}
local foreign = sum_keys(15)
local r = md_reserve(k, a, run, foreign)
if r[4] == 1 then
  redis.call('SET', KEYS[2], a.day .. '\t' .. a.model .. '\t' .. a.run, 'EXAT', a.expire_at)
elseif taken == 1 then
  run_apply(KEYS[7], KEYS[8], a.hold_id, 'gone', 0, 0, a.run_ttl)
end
return {r[1], r[2], r[3], r[4], run[1], run[2], foreign, run[3], run[4]}

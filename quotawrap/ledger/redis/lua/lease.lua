-- lease.lua: take (or renew) a named lease unless another holder has it.
-- KEYS: 1 the lease
-- ARGV: 1 holder  2 now  3 until  4 TTL seconds (garbage collection only: "until" decides, so a
--       simulated clock works)
-- Returns 1 when the holder has the lease, 0 when another holder does.
local holder, held_until = unpack(redis.call('HMGET', KEYS[1], 'holder', 'until'))
if holder and holder ~= ARGV[1] and tonumber(held_until) > tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'until', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1

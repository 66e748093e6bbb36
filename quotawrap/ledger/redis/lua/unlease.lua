-- unlease.lua: give a lease back if this holder has it.
-- KEYS: 1 the lease
-- ARGV: 1 holder
-- Returns 0.
if redis.call('HGET', KEYS[1], 'holder') == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0

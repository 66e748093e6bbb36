-- transition_many.lua (single node): transition_one on several holds in one call (the settler's batch), the
-- counters' writes of the whole batch made once at its end (batch_writes).
-- KEYS: transition_one's eleven keys for each hold, one hold after another
-- ARGV: one event (transition_args JSON) per hold, in the same order
-- Returns how many holds changed.
local changed, w = 0, batch_writes()
for i = 1, #ARGV do
  changed = changed + transition_both(KEYS, (i - 1) * 11, transition_args(i), w)[1]
end
flush_writes(w)
return changed

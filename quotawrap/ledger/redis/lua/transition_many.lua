-- transition_many.lua (single node): transition_one on several holds in one call (the settler's batch), the
-- counters' writes of the whole batch made once at its end (batch_writes); and an advance's steps (advance.lua).
-- KEYS: transition_one's thirteen keys for each hold, one hold after another; a step that names an advance
--       (a.drawn: the call was drawn from it; mode close: the hold is the advance) has two more after them:
--       the advance's hold and its location
-- ARGV: one event (transition_args JSON) per hold, in the same order; mode draw splits the call from its advance
--       and no more
-- Returns how many holds changed.
local changed, w, first = 0, batch_writes(), 0
for i = 1, #ARGV do
  local a = transition_args(i)
  local last = first + 13
  if a.drawn or a.mode == 'close' then
    local k = advance_keys(KEYS, first)
    if a.mode == 'close' then close_advance(k, a, a.drawn, w) else split_advance(k, a, a.drawn, w) end
    last = first + 15
  end
  if a.mode ~= 'draw' and a.mode ~= 'close' then
    changed = changed + transition_both(KEYS, first, a, w)[1]
  end
  first = last
end
flush_writes(w)
return changed

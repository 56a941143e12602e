-- inspect: read-only view of a target for operators: every slot held (a view never hides a
-- holder). Called first with slot 0's keys alone, which is all an exclusive lease has; when
-- slot 0's fence carries `top` or its lease is a permit, other slots may be held and the answer
-- is 'more': the caller asks again with every slot's lease.
-- KEYS: lease, fence
-- KEYS per further slot: slot_lease
--   slot 0's lease hash and fence (with the newest token of slots from 1); the lease hashes of
--   slots 1 and up (none, or as many as the largest permits value)
-- ARGV: (none)
-- Reply: 'more' | 'view <fence> <server_ms> <permits> <holders>' followed, for each held slot,
--   by ' <slot> <permits> <token> <acquired_ms> <pttl_ms> <owner_bytes> <owner> <lease_id_bytes>
--   <lease_id>' (permits: what that lease was granted under; the view's, the largest of them, 1
--   when none is held; free-text fields are preceded by their length in bytes)
local fence, top = read_fence(KEYS[2])
if not fence then return top end
local permits = 1
local held = {}
for s = 0, #KEYS - 2 do
  local key = KEYS[1]
  if s > 0 then key = KEYS[2 + s] end
  local lease, lease_err = read_lease(key)
  if lease_err then return lease_err end
  if lease then
    if #KEYS == 2 and lease.permits > 1 then return 'more' end
    permits = math.max(permits, lease.permits)
    table.insert(held, int(s) .. ' ' .. int(lease.permits) .. ' ' .. lease.token_text .. ' ' ..
      lease.acquired_ms .. ' ' .. int(lease.pttl) .. ' ' .. #lease.owner .. ' ' .. lease.owner ..
      ' ' .. #lease.lease_id .. ' ' .. lease.lease_id)
  end
end
if #KEYS == 2 and top then return 'more' end
local _, now_ms = server_now()
local reply = 'view ' .. int(math.max(fence, top or 0)) .. ' ' .. int(now_ms) .. ' ' ..
  int(permits) .. ' ' .. #held
if #held > 0 then reply = reply .. ' ' .. table.concat(held, ' ') end
return reply

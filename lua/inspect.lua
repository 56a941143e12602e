-- inspect: read-only view of a target for operators: every slot held, whatever the permits value
-- in force says (a view never hides a holder).
-- KEYS: lease, fence, permits
-- KEYS per further slot: slot_lease
--   slot 0's lease hash and fence (with the newest token of slots from 1); the permits value in
--   force; the lease hashes of slots 1 and up (as many as the largest permits value)
-- ARGV: (none)
-- Reply: 'view <fence> <server_ms> <permits> <holders>' followed, for each held slot, by
--   ' <slot> <permits> <token> <acquired_ms> <pttl_ms> <owner_bytes> <owner> <lease_id_bytes>
--   <lease_id>' (permits: what that lease was granted under)
--   (free-text fields are preceded by their length in bytes)
local fence, top = read_fence(KEYS[2])
if not fence then return top end
local in_force, permits_err = read_permits(KEYS[3])
if permits_err then return permits_err end
local permits = in_force or 1
local held = {}
for s = 0, #KEYS - 3 do
  local key = KEYS[1]
  if s > 0 then key = KEYS[3 + s] end
  local lease, lease_err = read_lease(key)
  if lease_err then return lease_err end
  if lease then
    if not in_force and lease.permits > permits then permits = lease.permits end
    table.insert(held, int(s) .. ' ' .. int(lease.permits) .. ' ' .. lease.token_text .. ' ' .. lease.acquired_ms .. ' ' ..
      int(lease.pttl) .. ' ' .. #lease.owner .. ' ' .. lease.owner .. ' ' .. #lease.lease_id ..
      ' ' .. lease.lease_id)
  end
end
local _, now_ms = server_now()
local reply = 'view ' .. int(math.max(fence, top or 0)) .. ' ' .. int(now_ms) .. ' ' .. int(permits) ..
  ' ' .. #held
if #held > 0 then reply = reply .. ' ' .. table.concat(held, ' ') end
return reply

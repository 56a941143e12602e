-- inspect: read-only view of a target for operators.
-- KEYS: lease, fence
-- ARGV: (none)
-- Reply: 'free <fence> <server_ms>' |
--   'held <fence> <server_ms> <token> <acquired_ms> <pttl_ms> <owner_bytes> <owner> <lease_id>'
--   (two free-text fields: the owner's length in bytes says where it ends)
local lease, lease_err = read_lease(KEYS[1])
if lease_err then return lease_err end
local fence, fence_err = read_fence(KEYS[2])
if not fence then return fence_err end
local _, now_ms = server_now()
if not lease then return 'free ' .. int(fence) .. ' ' .. int(now_ms) end
return 'held ' .. int(fence) .. ' ' .. int(now_ms) .. ' ' .. lease.token_text .. ' ' ..
  lease.acquired_ms .. ' ' .. int(lease.pttl) .. ' ' .. #lease.owner .. ' ' .. lease.owner ..
  ' ' .. lease.lease_id

-- inspect: read-only view of a target for operators.
-- KEYS: record, fence, v1_lease
--   (not the version 1 grant: it is not shown, and while a cluster slot migrates a call naming
--   a key that exists on neither node is answered TRYAGAIN, which a read must not be)
-- ARGV: (none)
-- Reply: 'free <fence> <server_ms>' |
--   'held <fence> <server_ms> <token> <acquired_ms> <pttl_ms> <owner_bytes> <owner> <lease_id>'
--   (two free-text fields: the owner's length in bytes says where it ends)
local _, now_ms = server_now()
local rec, rec_err = read_record({record = KEYS[1], v1_lease = KEYS[3]}, now_ms)
if not rec then return rec_err end
local fence, fence_err = read_fence(KEYS[2])
if not fence then return fence_err end
local lease = rec.lease
if not lease then return 'free ' .. int(fence) .. ' ' .. int(now_ms) end
return 'held ' .. int(fence) .. ' ' .. int(now_ms) .. ' ' .. lease.token_text .. ' ' ..
  lease.acquired_ms .. ' ' .. int(lease.expires_ms - now_ms) .. ' ' .. #lease.owner .. ' ' ..
  lease.owner .. ' ' .. lease.lease_id

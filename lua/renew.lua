-- renew: extend the lease, only for the exact (lease_id, owner, token) that holds it. A token
-- below the fence (an older record brought back by a restore) is not the holder's any more; a
-- fence below the holder's token (lost with the data) is raised again.
-- KEYS: lease, fence, reply, permits, slot_zero_fence
--   the slot's lease hash; the slot's fence (its newest token); the reply cache of this request
--   id; the permits value in force (kept with the lease under permits above 1); slot 0's fence
--   (the same key as the slot's for slot 0), which carries the newest token of the other slots
-- ARGV: lease_id, owner, token, ttl_ms, reply_ttl_ms, permits
-- Reply: 'renewed <ttl_ms> <server_ms>' | 'lost expired' | 'lost not_holder'
local ttl, reply_ttl = arg_int(ARGV[4]), arg_int(ARGV[5])
if not ttl or ttl < 1 or ttl > MAX_TTL_MS then return invalid('ttl_ms must be from 1 to 86400000') end
if not reply_ttl or reply_ttl < 1 then return invalid('reply_ttl_ms must be a positive integer') end
local token = arg_int(ARGV[3])
if not token or token == 0 then return invalid('token must be an integer from 1 to 2^53-1') end
local permits = arg_int(ARGV[6])
if not permits or permits < 1 or permits > MAX_PERMITS then
  return invalid('permits must be from 1 to ' .. MAX_PERMITS)
end

local bound = binding('renew', ARGV[1], ARGV[2], ARGV[3])
local cached, err = cached_reply(KEYS[3], bound, 'renew')
if err then return err end

-- The holder is checked first, for a retry too: a cached 'renewed' is answered only while the
-- lease it renewed still stands, never for a lease that expired or passed on since.
local lease, lease_err = read_lease(KEYS[1])
if lease_err then return lease_err end
if not lease then return 'lost expired' end
if lease.lease_id ~= ARGV[1] or lease.owner ~= ARGV[2] or lease.token_text ~= ARGV[3] then
  return 'lost not_holder'
end
local fence, top = read_fence(KEYS[2])
if not fence then return top end
if lease.token < fence then return 'lost not_holder' end
if lease.permits ~= permits then
  return invalid('permits ' .. ARGV[6] .. ' is not what this lease was granted under (' ..
    int(lease.permits) .. ')')
end
-- A fence lost (or lowered) while the lease survived is raised again, on a retry too.
if fence < lease.token then redis.call('SET', KEYS[2], fence_text(lease.token_text, top)) end
-- A permit of a slot from 1 keeps `top` at least at its token, on a retry too: slot 0's fence
-- lost or lowered would otherwise let an exclusive acquire skip the value in force.
if permits > 1 and KEYS[5] ~= KEYS[2] then
  local fence0, top0 = read_fence(KEYS[5])
  if not fence0 then return top0 end
  if (top0 or 0) < lease.token then
    redis.call('SET', KEYS[5], int(fence0) .. ' ' .. lease.token_text)
  end
end
if cached then return cached end
local _, now_ms = server_now()
if permits > 1 then keep_permits(KEYS[4], ARGV[6], ttl) end
redis.call('PEXPIRE', KEYS[1], ttl)
return remember(KEYS[3], bound, 'renewed ' .. ARGV[4] .. ' ' .. int(now_ms), reply_ttl)

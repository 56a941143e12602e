-- release: compare-and-delete; only the exact (lease_id, owner, token) that holds the lease.
-- The fence stays, so the next acquire still issues a larger token.
-- Under permits above 1, the permits value in force goes with the last permit released, so a
-- claim asking another value is admitted at once.
-- KEYS: lease, reply, permits
-- KEYS per further slot: other_lease
--   the slot's lease hash; the reply cache of this request id; the permits value in force; the
--   lease hashes of the target's other slots
-- ARGV: lease_id, owner, token, reply_ttl_ms
-- Reply: 'released' | 'not_holder'
local reply_ttl = arg_int(ARGV[4])
if not reply_ttl or reply_ttl < 1 then return invalid('reply_ttl_ms must be a positive integer') end
local token = arg_int(ARGV[3])
if not token or token == 0 then return invalid('token must be an integer from 1 to 2^53-1') end

local bound = binding('release', ARGV[1], ARGV[2], ARGV[3])
local cached, err = cached_reply(KEYS[2], bound, 'release')
if cached then return cached elseif err then return err end

local lease, lease_err = read_lease(KEYS[1])
if lease_err then return lease_err end
if not lease or lease.lease_id ~= ARGV[1] or lease.owner ~= ARGV[2] or lease.token_text ~= ARGV[3] then
  return 'not_holder'
end
if #KEYS ~= 2 + lease.permits then
  return invalid('this lease was granted under permits ' .. int(lease.permits) .. ': its ' ..
    'release names the permits value and every other slot')
end
redis.call('DEL', KEYS[1])
if lease.permits > 1 then
  local others_held = false
  for i = 4, #KEYS do
    if redis.call('EXISTS', KEYS[i]) == 1 then others_held = true break end
  end
  if not others_held then redis.call('DEL', KEYS[3]) end
end
return remember(KEYS[2], bound, 'released', reply_ttl)

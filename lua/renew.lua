-- renew: extend the lease, only for the exact (lease_id, owner, token) that holds it.
-- KEYS[1] lease hash   KEYS[2] reply cache of this request id
-- ARGV[1] lease_id  ARGV[2] owner  ARGV[3] token  ARGV[4] ttl_ms  ARGV[5] reply_ttl_ms
-- Reply: {'renewed', pttl_ms, server_ms} | {'lost', 'expired' | 'not_holder'}
local cached, err = cached_reply(KEYS[2])
if cached then return cached elseif err then return err end

local ttl, reply_ttl = arg_int(ARGV[4]), arg_int(ARGV[5])
if not ttl or ttl < 1 then return invalid('ttl_ms must be a positive integer') end
if not reply_ttl or reply_ttl < 1 then return invalid('reply_ttl_ms must be a positive integer') end

local lease, lease_err = read_lease(KEYS[1])
if lease_err then return lease_err end
if not lease then return {'lost', 'expired'} end
if lease.lease_id ~= ARGV[1] or lease.owner ~= ARGV[2] or lease.token ~= ARGV[3] then
  return {'lost', 'not_holder'}
end
redis.call('PEXPIRE', KEYS[1], ttl)
local _, now_ms = server_now()
return remember(KEYS[2], {'renewed', int(ttl), int(now_ms)}, reply_ttl)

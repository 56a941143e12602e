-- release: compare-and-end; only the exact (lease_id, owner, token) that holds the lease. The
-- lease ends at once (expires_ms 0, with the plain HSET every other write uses: no command
-- beyond version 1's ACL rule); its fields stay until the next grant overwrites them. The fence
-- and the record's grant stay, so the next acquire still issues a larger token and a replay of
-- the spent acquire is still refused.
-- KEYS: record, reply, v1_lease, v1_grant
--   the target record; the reply cache of this request id; the version 1 lease and grant keys
--   (see acquire.lua)
-- ARGV: lease_id, owner, token, reply_ttl_ms
-- Reply: 'released' | 'not_holder'
local reply_ttl = arg_int(ARGV[4])
if not reply_ttl or reply_ttl < 1 then return invalid('reply_ttl_ms must be a positive integer') end
local token = arg_int(ARGV[3])
if not token or token == 0 then return invalid('token must be an integer from 1 to 2^53-1') end
local keys = {record = KEYS[1], reply = KEYS[2], v1_lease = KEYS[3], v1_grant = KEYS[4]}

local bound = binding('release', ARGV[1], ARGV[2], ARGV[3])
local cached, err = cached_reply(KEYS[2], bound, 'release')
if cached then return cached elseif err then return err end

local _, now_ms = server_now()
local rec, rec_err = read_record(keys, now_ms)
if not rec then return rec_err end
local lease = rec.lease
if not lease or lease.lease_id ~= ARGV[1] or lease.owner ~= ARGV[2] or lease.token_text ~= ARGV[3] then
  return 'not_holder'
end
write_record(keys, rec, now_ms, 'expires_ms', '0')
return remember(KEYS[2], bound, 'released', reply_ttl)

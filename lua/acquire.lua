-- acquire: claim the target when it is free or its lease expired; re-entrant for the same lease.
-- KEYS[1] lease hash   KEYS[2] fence   KEYS[3] reply cache of this request id
-- ARGV[1] lease_id  ARGV[2] owner  ARGV[3] ttl_ms  ARGV[4] min_token  ARGV[5] reply_ttl_ms
-- Reply: {'acquired', token, pttl_ms, server_ms, acquired_ms} | {'held', owner, pttl_ms}
local ttl, min_token, reply_ttl = arg_int(ARGV[3]), arg_int(ARGV[4]), arg_int(ARGV[5])
if not ttl or ttl < 1 then return invalid('ttl_ms must be a positive integer') end
if not min_token then return invalid('min_token must be a non-negative integer') end
if not reply_ttl or reply_ttl < 1 then return invalid('reply_ttl_ms must be a positive integer') end

local cached, err = cached_reply(KEYS[3])
if cached then
  -- Every path that answers 'acquired' writes, a replayed reply too: the client's WAITAOF (the
  -- durability option) waits for this connection's last write, and a retry may arrive on a new
  -- connection that has written nothing yet. Refreshing the cache entry orders a write after
  -- the original grant in the replication stream, so the wait covers the grant.
  redis.call('PEXPIRE', KEYS[3], reply_ttl)
  return cached
elseif err then
  return err
end

local lease, lease_err = read_lease(KEYS[1])
if lease_err then return lease_err end

if lease then
  if lease.lease_id ~= ARGV[1] or lease.owner ~= ARGV[2] then
    return {'held', lease.owner, int(redis.call('PTTL', KEYS[1]))}
  end
  -- Already ours (a retry after the cache expired, or a controller that lost its status write):
  -- same token, fresh TTL.
  local _, now_ms = server_now()
  redis.call('PEXPIRE', KEYS[1], ttl)
  return remember(KEYS[3], {'acquired', lease.token, int(ttl), int(now_ms), lease.acquired_ms}, reply_ttl)
end

local fence, fence_err = read_fence(KEYS[2])
if fence_err then return fence_err end
-- TIME only where a token or a time is answered: the `held` refusal above does not need it.
local now_us, now_ms = server_now()
-- Tokens strictly grow even if the fence was lost with the data: the caller's floor covers
-- tokens it has seen, the server clock covers the rest.
local token = int(math.max(fence + 1, min_token + 1, now_us))
-- Formatted once: %.0f of a 13- to 16-digit number is one of the costlier steps here.
local now = int(now_ms)
redis.call('HSET', KEYS[1], 'record_version', RECORD_VERSION, 'lease_id', ARGV[1], 'owner', ARGV[2],
  'token', token, 'acquired_ms', now)
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('SET', KEYS[2], token)
return remember(KEYS[3], {'acquired', token, int(ttl), now, now}, reply_ttl)

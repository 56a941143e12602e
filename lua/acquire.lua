-- acquire: claim the target when it is free or its lease expired; re-entrant for the same lease.
-- KEYS: lease, fence, reply, grant
--   the lease hash; the fence (newest token); the reply cache of this request id; the request id
--   of the newest grant (never expires)
-- ARGV: lease_id, owner, ttl_ms, min_token, reply_ttl_ms, request_id
-- Reply: 'acquired <token> <ttl_ms> <server_ms> <acquired_ms>' | 'held <pttl_ms> <owner>' |
--   'expired <token>' (a retry whose grant has ended)
local ttl, min_token, reply_ttl = arg_int(ARGV[3]), arg_int(ARGV[4]), arg_int(ARGV[5])
if not ttl or ttl < 1 or ttl > MAX_TTL_MS then return invalid('ttl_ms must be from 1 to 86400000') end
if not min_token then return invalid('min_token must be an integer from 0 to 2^53-2') end
if min_token >= MAX_TOKEN then return exhausted(0, min_token) end
if not reply_ttl or reply_ttl < 1 then return invalid('reply_ttl_ms must be a positive integer') end
-- What read_lease cannot read back is never written: an empty lease id or owner would make the
-- target's record corrupt.
if ARGV[1] == '' or #ARGV[1] > 256 then return invalid('lease_id must be 1 to 256 bytes') end
if ARGV[2] == '' or #ARGV[2] > 253 then return invalid('owner must be 1 to 253 bytes') end

-- The floor is bound too: it decides what a grant may answer (a token above it), so a retry
-- with another floor is another call, not a replay of this one. (ARGV[3] and ARGV[4] are
-- canonical integers once arg_int accepted them, so they are used as they came.)
local bound = binding('acquire', ARGV[1], ARGV[2], ARGV[4])
local cached, err = cached_reply(KEYS[3], bound, 'acquire')
if err then return err end

local lease, lease_err = read_lease(KEYS[1])
if lease_err then return lease_err end

if cached then
  -- A retry is answered with its first reply only while the grant it reports still stands:
  -- the same lease id, owner and token hold the target. After an expiry, a release or a newer
  -- token, the caller learns that its grant ended and takes nothing (it never reads a grant
  -- that is gone as its own).
  local replayed = string.match(cached, '^acquired (%d+) ')
  if not replayed then
    return corrupt('reply cache at ' .. KEYS[3] .. ' is not an acquire reply')
  end
  if not lease or lease.lease_id ~= ARGV[1] or lease.owner ~= ARGV[2] or
      lease.token_text ~= replayed then
    return 'expired ' .. replayed
  end
  local fence, fence_err = read_fence(KEYS[2])
  if not fence then return fence_err end
  -- Every path that answers 'acquired' writes, a replayed reply too: the client's WAITAOF (the
  -- durability option) waits for this connection's last write, and a retry may arrive on a new
  -- connection that has written nothing yet. Refreshing the cache entry orders a write after
  -- the original grant in the replication stream, so the wait covers the grant.
  redis.call('PEXPIRE', KEYS[3], reply_ttl)
  -- A replayed grant leaves the fence at least at its token, like every path that answers one.
  if fence < lease.token then redis.call('SET', KEYS[2], replayed) end
  return cached
end

if lease and (lease.lease_id ~= ARGV[1] or lease.owner ~= ARGV[2]) then
  return 'held ' .. int(lease.pttl) .. ' ' .. lease.owner
end

local fence, fence_err = read_fence(KEYS[2])
if not fence then return fence_err end
-- TIME only where a token or a time is answered: the `held` refusal above does not need it.
local now_us, now_ms = server_now()
local now = int(now_ms)

if lease then
  -- Already ours (a retry after the cache expired, or a controller that lost its status write):
  -- the same token with a fresh TTL, unless that token is not above the caller's floor or is
  -- below the fence (an older record brought back by a restore or failover). Then the tenure
  -- gets a new, larger token: a caller is never handed a token lower than one it has seen.
  local token = lease.token_text
  if lease.token <= min_token or lease.token < fence then
    local issued, refused = next_token(fence, min_token, now_us)
    if not issued then return refused end
    token = int(issued)
    -- Stopped after the HSET (a refused SET), the lease keeps its new token above the fence,
    -- which its next renewal raises: never unreadable, never below a token issued.
    redis.call('HSET', KEYS[1], 'token', token)
    redis.call('SET', KEYS[2], token)
    redis.call('SET', KEYS[4], ARGV[6])
  elseif fence < lease.token then
    -- The fence was lost (or lowered) while the lease survived: raise it again.
    redis.call('SET', KEYS[2], token)
  end
  redis.call('PEXPIRE', KEYS[1], ttl)
  return remember(KEYS[3], bound,
    'acquired ' .. token .. ' ' .. ARGV[3] .. ' ' .. now .. ' ' .. lease.acquired_ms, reply_ttl)
end

-- A request id that issued the newest token is spent: replayed after its cached reply expired
-- (after a release or an expiry), it must not take a second tenure.
local last_request = redis.pcall('GET', KEYS[4])
if type(last_request) == 'table' and last_request.err then
  return read_error(last_request, 'grant record at ' .. KEYS[4] .. ' is not a string')
end
if last_request == ARGV[6] then
  return invalid('request id already acquired token ' .. int(fence) .. ' on this target and its ' ..
    'cached reply expired; a replay never takes a second tenure: use a new request id')
end

local issued, refused = next_token(fence, min_token, now_us)
if not issued then return refused end
local token = int(issued)
-- The lease hash and its expiry must be written together: a hash left without one by a refused
-- PEXPIRE would fail every later call on the target as corrupt.
local denied = may_run('PEXPIRE', KEYS[1], ARGV[3])
if denied then return denied end
-- The lease first: a user without HSET is stopped before anything is written; stopped after
-- it (a refused SET), the lease holds a token above the fence, which its next renewal raises.
redis.call('HSET', KEYS[1], 'record_version', RECORD_VERSION, 'lease_id', ARGV[1], 'owner', ARGV[2],
  'token', token, 'acquired_ms', now)
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('SET', KEYS[2], token)
redis.call('SET', KEYS[4], ARGV[6])
return remember(KEYS[3], bound, 'acquired ' .. token .. ' ' .. ARGV[3] .. ' ' .. now .. ' ' .. now,
  reply_ttl)

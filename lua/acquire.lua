-- acquire: claim a permit of the target; re-entrant for the same lease. With permits 1 (the
-- exclusive lease) the one permit is slot 0; with permits N, the lowest of slots 0 to N-1 that is
-- free or whose lease expired. Every slot has its own lease, fence (newest grant of the slot) and
-- grant record; slot 0's are the exclusive lease's, and slot 0's fence carries `top`, the newest
-- token of the other slots, once one was granted (see read_fence): every token issued is at most
-- the larger of the two, and each grant is above both. One path serves every permits value: with
-- permits 1 it reads slot 0 alone and skips what only permits need (the permits value in force,
-- `top` on slot 0's fence), so an exclusive lease pays nothing for permits.
-- KEYS: lease, fence, reply, grant, permits
-- KEYS per further slot: slot_lease, slot_fence, slot_grant
--   slot 0's lease hash, fence and grant record (the request id of its newest grant, never
--   expires); the reply cache of this request id; the permits value in force while a permit
--   granted under permits above 1 may be held; then slots 1 to N-1
-- ARGV: lease_id, owner, ttl_ms, min_token, reply_ttl_ms, request_id, permits
-- Reply: 'acquired <token> <ttl_ms> <server_ms> <acquired_ms> <slot>' |
--   'held <pttl_ms> <owner>' (every slot held; the one that expires first) |
--   'expired <token>' (a retry whose grant has ended) | 'conflict <permits in force>'
local ttl, min_token, reply_ttl = arg_int(ARGV[3]), arg_int(ARGV[4]), arg_int(ARGV[5])
local permits = arg_int(ARGV[7])
if not ttl or ttl < 1 or ttl > MAX_TTL_MS then return invalid('ttl_ms must be from 1 to 86400000') end
if not min_token then return invalid('min_token must be an integer from 0 to 2^53-2') end
if min_token >= MAX_TOKEN then return exhausted(0, min_token) end
if not reply_ttl or reply_ttl < 1 then return invalid('reply_ttl_ms must be a positive integer') end
if not permits or permits < 1 or permits > MAX_PERMITS then
  return invalid('permits must be from 1 to ' .. MAX_PERMITS)
end
if #KEYS ~= 5 + 3 * (permits - 1) then
  return invalid('permits ' .. ARGV[7] .. ' needs ' .. (5 + 3 * (permits - 1)) .. ' keys')
end
-- What read_lease cannot read back is never written: an empty lease id or owner would make the
-- target's record corrupt.
if ARGV[1] == '' or #ARGV[1] > 256 then return invalid('lease_id must be 1 to 256 bytes') end
if ARGV[2] == '' or #ARGV[2] > 253 then return invalid('owner must be 1 to 253 bytes') end
local shared = permits > 1

-- The keys of slot `s`: slot 0's are the exclusive lease's.
local function lease_key(s) if s == 0 then return KEYS[1] end return KEYS[3 + 3 * s] end
local function fence_key(s) if s == 0 then return KEYS[2] end return KEYS[4 + 3 * s] end
local function grant_key(s) if s == 0 then return KEYS[4] end return KEYS[5 + 3 * s] end

-- The floor and the permits are bound too: they decide what a grant may answer, so a retry
-- with another floor or permits is another call, not a replay of this one. (ARGV[3], ARGV[4]
-- and ARGV[7] are canonical integers once arg_int accepted them, so they are used as they
-- came; permits 1 binds what earlier versions bound, so their cached replies still match.)
local bound = binding('acquire', ARGV[1], ARGV[2], ARGV[4], shared and ARGV[7] or nil)
local cached, err = cached_reply(KEYS[3], bound, 'acquire')
if err then return err end

if cached then
  -- A retry is answered with its first reply only while the grant it reports still stands:
  -- the same lease id, owner and token hold its slot. After an expiry, a release or a newer
  -- token, the caller learns that its grant ended and takes nothing (it never reads a grant
  -- that is gone as its own).
  local replayed, slot_text
  if shared then
    replayed, slot_text = string.match(cached, '^acquired (%d+) %d+ %d+ %d+ (%d+)$')
  else
    -- An exclusive grant is cached without its slot (see granted), by every version.
    replayed, slot_text = string.match(cached, '^acquired (%d+) %d+ %d+ %d+$'), '0'
    cached = cached .. ' 0'
  end
  local slot = arg_int(slot_text)
  if not replayed or not slot or slot >= permits then
    return corrupt('reply cache at ' .. KEYS[3] .. ' is not an acquire reply')
  end
  local lease, lease_err = read_lease(lease_key(slot))
  if lease_err then return lease_err end
  if not lease or lease.lease_id ~= ARGV[1] or lease.owner ~= ARGV[2] or
      lease.token_text ~= replayed then
    return 'expired ' .. replayed
  end
  local fence, top = read_fence(fence_key(slot))
  if not fence then return top end
  -- Every path that answers 'acquired' writes, a replayed reply too: the client's WAITAOF (the
  -- durability option) waits for this connection's last write, and a retry may arrive on a new
  -- connection that has written nothing yet. Refreshing the cache entry orders a write after
  -- the original grant in the replication stream, so the wait covers the grant.
  redis.call('PEXPIRE', KEYS[3], reply_ttl)
  -- A replayed grant leaves its slot's fence at least at its token, like every path that
  -- answers one, and `top` with it (`top` only grows).
  if fence < lease.token then
    redis.call('SET', fence_key(slot), fence_text(replayed, top))
    if slot > 0 then
      local fence0, top0 = read_fence(KEYS[2])
      if not fence0 then return top0 end
      if (top0 or 0) < lease.token then
        redis.call('SET', KEYS[2], int(fence0) .. ' ' .. replayed)
      end
    end
  end
  return cached
end

-- Every slot is read before anything is decided: a record that cannot be read fails the call
-- closed whatever slot it is in (it could be a holder), and a holder granted under another
-- permits value refuses the call, so no instant ever has more holders than any claim allows.
local mine, mine_slot, free_slot, first_out, conflict
for s = 0, permits - 1 do
  local lease, lease_err = read_lease(lease_key(s))
  if lease_err then return lease_err end
  if lease then
    if lease.permits ~= permits then conflict = lease.permits end
    if lease.lease_id == ARGV[1] and lease.owner == ARGV[2] then
      mine, mine_slot = lease, s
    elseif not first_out or lease.pttl < first_out.pttl then
      first_out = lease
    end
  elseif not free_slot then
    free_slot = s
  end
end
if conflict then return 'conflict ' .. int(conflict) end
-- The refusal of a held target needs nothing more: no fence, no clock.
if not mine and not free_slot then
  return 'held ' .. int(first_out.pttl) .. ' ' .. first_out.owner
end

local fence0, top = read_fence(KEYS[2])
if not fence0 then return top end
-- Permits granted under another value may be held in slots this call did not read. With
-- permits 1, only a target that has granted permits (`top` is set) can have any.
if shared or top then
  local in_force, permits_err = read_permits(KEYS[5])
  if permits_err then return permits_err end
  if in_force and in_force ~= permits then return 'conflict ' .. int(in_force) end
end
local newest = math.max(fence0, top or 0)
-- TIME only where a token or a time is answered.
local now_us, now_ms = server_now()
local now = int(now_ms)

-- Records a token just issued (above every token of the target) as slot `s`'s newest grant.
-- An exclusive grant writes a plain fence: no permit is held beside it, so `top` is dropped and
-- the target's next exclusive acquire reads no permits value.
local function issued_to(s, token_text)
  if s == 0 then
    redis.call('SET', KEYS[2], shared and fence_text(token_text, top) or token_text)
  else
    redis.call('SET', fence_key(s), token_text)
    redis.call('SET', KEYS[2], int(fence0) .. ' ' .. token_text)
  end
end

-- The grant's reply. An exclusive grant is cached without its slot, in the form every earlier
-- version replays and reads (a retry across a rollback still gets its grant); a replay here
-- names slot 0 again.
local function granted(token, slot, acquired_ms)
  local reply = 'acquired ' .. token .. ' ' .. ARGV[3] .. ' ' .. now .. ' ' .. acquired_ms
  if shared then return remember(KEYS[3], bound, reply .. ' ' .. slot, reply_ttl) end
  return remember(KEYS[3], bound, reply, reply_ttl) .. ' 0'
end

if mine then
  -- Already ours (a retry after the cache expired, or a controller that lost its status
  -- write): the same slot and token with a fresh TTL, unless that token is not above the
  -- caller's floor or is below the slot's fence (an older record brought back by a restore or
  -- failover). Then the tenure gets a new, larger token: a caller is never handed a token lower
  -- than one it has seen.
  local slot_fence, slot_top = fence0, top
  if mine_slot > 0 then
    slot_fence, slot_top = read_fence(fence_key(mine_slot))
    if not slot_fence then return slot_top end
  end
  local token, issued = mine.token_text, nil
  if mine.token <= min_token or mine.token < slot_fence then
    local refused
    issued, refused = next_token(newest, min_token, now_us)
    if not issued then return refused end
  end
  -- Past every refusal: the value in force is kept for as long as this tenure.
  if shared then keep_permits(KEYS[5], ARGV[7], ttl) end
  if issued then
    token = int(issued)
    -- Stopped after the HSET (a refused SET), the lease keeps its new token above the fence,
    -- which its next renewal raises: never unreadable, never below a token issued.
    redis.call('HSET', lease_key(mine_slot), 'token', token)
    issued_to(mine_slot, token)
    redis.call('SET', grant_key(mine_slot), ARGV[6])
  elseif slot_fence < mine.token then
    -- The slot's fence was lost (or lowered) while the lease survived: raise it again, and
    -- `top` with it (it only grows).
    if mine_slot == 0 then
      redis.call('SET', KEYS[2], fence_text(token, top))
    else
      redis.call('SET', fence_key(mine_slot), token)
      if (top or 0) < mine.token then redis.call('SET', KEYS[2], int(fence0) .. ' ' .. token) end
    end
  end
  redis.call('PEXPIRE', lease_key(mine_slot), ttl)
  return granted(token, mine_slot, mine.acquired_ms)
end

-- A request id that issued a slot's newest token is spent: replayed after its cached reply
-- expired (after a release or an expiry), it must not take a second tenure.
for s = 0, permits - 1 do
  local last_request = redis.pcall('GET', grant_key(s))
  if type(last_request) == 'table' and last_request.err then
    return read_error(last_request, 'grant record at ' .. grant_key(s) .. ' is not a string')
  end
  if last_request == ARGV[6] then
    return invalid('request id already acquired a token on this target and its cached reply ' ..
      'expired; a replay never takes a second tenure: use a new request id')
  end
end

local issued, refused = next_token(newest, min_token, now_us)
if not issued then return refused end
local token = int(issued)
local lease = lease_key(free_slot)
-- The lease hash and its expiry must be written together: a hash left without one by a
-- refused PEXPIRE would fail every later call on the target as corrupt.
local denied = may_run('PEXPIRE', lease, ARGV[3])
if denied then return denied end
-- Under permits above 1, the value in force first: stopped after it, nothing is held and the
-- value expires with the TTL; a permit is never held without it.
if shared then keep_permits(KEYS[5], ARGV[7], ttl) end
-- The lease next: a user without HSET is stopped before anything else is written; stopped
-- after it (a refused SET), the lease holds a token above the fence, which its next renewal
-- raises. An exclusive lease's record has no `permits` field (read_lease reads it as 1).
local fields = {'record_version', RECORD_VERSION, 'lease_id', ARGV[1], 'owner', ARGV[2],
  'token', token, 'acquired_ms', now}
if shared then fields[11], fields[12] = 'permits', ARGV[7] end
redis.call('HSET', lease, unpack(fields))
redis.call('PEXPIRE', lease, ttl)
issued_to(free_slot, token)
redis.call('SET', grant_key(free_slot), ARGV[6])
return granted(token, free_slot, now)

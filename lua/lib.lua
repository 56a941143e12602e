-- Shared prelude, prepended to every script at compile time (see src/store/valkey/scripts.rs).
-- Everything here is local: Valkey refuses scripts that create globals.
--
-- Records are validated on every read and anything unexpected fails closed with a `TLCORRUPT`
-- error: a record we cannot read is never mistaken for a free target.
--
-- Every script answers one string: its outcome, then its fields, separated by single spaces. At
-- most one field is free text (an owner, a value, a repair note) and it comes last; the one
-- reply with two (inspect's) gives the first one's length. A string costs the server a fraction
-- of a Lua table (docs/performance.md), and a cached reply is stored as it is answered.
--
-- This prelude runs on every call (EVALSHA has no load-time code), so it only defines what the
-- common paths use: every closure, table and string built here is paid for by every call. What
-- only targets without a record need (reading and moving layout version 1's keys) is built inside
-- `v1_layout()`, on those paths alone.

-- The layout of the target record (the `record` key): a hash that never expires, holding the
-- lease while one is held and the request id of the newest grant. Version 1 kept the lease in
-- its own expiring hash (the `lease` key, now `v1_lease`) and the grant in its own string.
local RECORD_VERSION = '2'

-- The largest token: 2^53-1, the largest integer a Lua number (a double) holds exactly. Every
-- token, floor and stored fence is checked against it; nothing above it is ever issued.
local MAX_TOKEN = 9007199254740991

-- Integers are formatted by hand: Lua's tostring() and Valkey's argument conversion use %.14g,
-- which would round a 16-digit fencing token.
local function int(n)
  return string.format('%.0f', n)
end

local function corrupt(what)
  return redis.error_reply('TLCORRUPT ' .. what)
end

local function invalid(what)
  return redis.error_reply('TLINVALID ' .. what)
end

-- The error of a failed pcall'd read: a record of the wrong type is corrupt; anything else (an
-- ACL refusal, an out-of-memory, ...) is passed on unchanged, never disguised as corruption.
local function read_error(r, what)
  if string.find(r.err, 'WRONGTYPE', 1, true) then return corrupt(what) end
  return redis.error_reply(r.err)
end

-- Parses a canonical decimal integer from 0 to MAX_TOKEN ('0', or digits without a leading
-- zero); nil for anything else: signs, exponents, hex, spaces, fractions and values a double
-- would round are all refused rather than guessed at.
local function arg_int(s)
  if type(s) ~= 'string' or #s > 16 then return nil end
  if s ~= '0' and not string.match(s, '^[1-9]%d*$') then return nil end
  local n = tonumber(s)
  if n > MAX_TOKEN then return nil end
  return n
end

-- The longest lease TTL, 24 hours: what the client accepts (`Ttl`), checked again here so that no
-- caller can write an expiry read_record would refuse.
local MAX_TTL_MS = 86400000

-- Server time from TIME, in microseconds and milliseconds.
local function server_now()
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  return us, math.floor(us / 1000)
end

local function exhausted(fence, min_token)
  return invalid('no token can be issued: the fence (' .. int(fence) .. ') or the floor (' ..
    int(min_token) .. ') is at the largest token 2^53-1')
end

-- How far ahead of the server clock (in microseconds) a token may be: one hour. A floor further
-- ahead is refused, and a target without a fence starts this far ahead. Together they make the
-- floor survive the loss of everything in Valkey: every token issued is at most (clock when it
-- was issued + MAX_LEAD), so a target that lost its fence starts above every token it had.
local MAX_LEAD = 3600000000

-- The next token: above the fence, above the caller's floor, and at least the server clock in
-- microseconds (MAX_LEAD ahead of it for a target without a fence). Returns the token, or
-- (nil, error_reply) for a floor too far ahead or a token that would pass MAX_TOKEN.
local function next_token(fence, min_token, now_us)
  if min_token > now_us + MAX_LEAD then
    return nil, invalid('floor ' .. int(min_token) .. ' is more than an hour ahead of the server ' ..
      'clock (' .. int(now_us) .. ' microseconds): no token this store issues is that large, so ' ..
      'it did not come from this store')
  end
  local base = now_us
  if fence == 0 then base = now_us + MAX_LEAD end
  local token = math.max(fence + 1, min_token + 1, base)
  if token > MAX_TOKEN then return nil, exhausted(fence, min_token) end
  return token
end

-- What a request id is bound to: the operation and every argument that identifies the call
-- (three, or four with `d`). Each part is length-prefixed, so no two different argument lists
-- give the same text; the text is version 1's, so its cached replies still match. One
-- concatenation, no table: this runs on every mutating call.
local function binding(op, a, b, c, d)
  local text = #op .. ':' .. op .. ',' .. #a .. ':' .. a .. ',' .. #b .. ':' .. b .. ',' ..
    #c .. ':' .. c
  if d then text = text .. ',' .. #d .. ':' .. d end
  return redis.sha1hex(text)
end

-- Layout version 1, built only where a target has no record yet and by repair (see the
-- prelude's note). Returns {read_lease(key, now_ms), read_grant(key), write_marker(keys, now_ms),
-- move(keys, rec, now_ms)}.
local function v1_layout()
  -- What version 2 leaves at a version 1 lease key: a lease that version 1 reads as held by
  -- this owner for ten years, under a lease id of its own (a SHA-1 that includes the random
  -- request id of the call that wrote it) and token 1, which version 1 never issues (its tokens
  -- are clock-based). A version 1 client still running after the upgrade is refused (`held`,
  -- `not_holder`) and names the cause, instead of finding the key empty and granting a second
  -- tenure beside the record's. Short, because every target written by version 2 carries one.
  local MOVED_OWNER = 'targetlease-record-v2 (upgrade this client)'
  local MOVED_PREFIX = 'moved-to-record-v2:'
  local MOVED_TTL_MS = 315360000000
  local v1 = {}

  -- Reads a version 1 lease hash: nil when absent or moved, the lease otherwise, or
  -- (false, error_reply) for anything version 1 itself would have refused.
  function v1.read_lease(key, now_ms)
    if redis.call('EXISTS', key) == 0 then return nil end
    local r = redis.pcall('HMGET', key, 'record_version', 'lease_id', 'owner', 'token', 'acquired_ms')
    if type(r) == 'table' and r.err then
      return false, read_error(r, 'version 1 lease record at ' .. key .. ' is not a hash')
    end
    if r[1] ~= '1' then
      return false, corrupt('version 1 lease record at ' .. key .. ' has record_version ' ..
        tostring(r[1]) .. ' (expected 1)')
    end
    -- The marker: all three, so that a version 1 caller naming itself like the marker does
    -- not pass for one (it cannot get token 1).
    if r[3] == MOVED_OWNER and r[4] == '1' and string.sub(r[2] or '', 1, #MOVED_PREFIX) == MOVED_PREFIX then
      return nil
    end
    local token = arg_int(r[4])
    if not r[2] or r[2] == '' or not r[3] or r[3] == '' or not token or token == 0 or not arg_int(r[5]) then
      return false, corrupt('version 1 lease record at ' .. key .. ' lacks a field or has a ' ..
        'non-numeric token or acquired_ms')
    end
    local pttl = redis.call('PTTL', key)
    if pttl < 0 then
      return false, corrupt('version 1 lease record at ' .. key .. ' has no expiry (a lease must expire)')
    end
    return {lease_id = r[2], owner = r[3], token = token, token_text = r[4], acquired_ms = r[5],
      expires_ms = now_ms + pttl}
  end

  -- Reads a version 1 grant: the request id, nil, or (false, error_reply).
  function v1.read_grant(key)
    local grant = redis.pcall('GET', key)
    if type(grant) == 'table' and grant.err then
      return false, read_error(grant, 'version 1 grant record at ' .. key .. ' is not a string')
    end
    return grant or nil
  end

  -- (Re)writes the moved marker at `keys.v1_lease`; `keys.reply` (this call's request id)
  -- makes its lease id one nobody can derive.
  function v1.write_marker(keys, now_ms)
    redis.call('DEL', keys.v1_lease)
    redis.call('HSET', keys.v1_lease, 'record_version', '1', 'lease_id',
      MOVED_PREFIX .. redis.sha1hex(keys.record .. ' ' .. keys.reply .. ' ' .. int(now_ms)),
      'owner', MOVED_OWNER, 'token', '1', 'acquired_ms', int(now_ms))
    redis.call('PEXPIRE', keys.v1_lease, MOVED_TTL_MS)
  end

  -- Creates the record of a target that has none: what the version 1 keys held (the lease, the
  -- grant) moves into it, the version 1 grant is dropped and the moved marker is left at the
  -- version 1 lease key, all in the calling script; from then on the record alone says who
  -- holds the target.
  function v1.move(keys, rec, now_ms)
    redis.call('HSET', keys.record, 'record_version', RECORD_VERSION)
    if rec.grant then redis.call('HSET', keys.record, 'grant', rec.grant) end
    local l = rec.lease
    if l then
      redis.call('HSET', keys.record, 'lease_id', l.lease_id, 'owner', l.owner, 'token',
        l.token_text, 'acquired_ms', l.acquired_ms, 'expires_ms', int(l.expires_ms))
    end
    redis.call('DEL', keys.v1_grant)
    v1.write_marker(keys, now_ms)
    rec.exists = true
  end

  return v1
end

-- Reads the target record at `keys.record` as of `now_ms`. Returns
--   {exists = bool, lease = nil | {lease_id, owner, token, token_text, acquired_ms, expires_ms},
--    grant = nil | request id}
-- where `lease` is set only while the lease is held (expires_ms > now_ms), or
-- (false, error_reply). A target without a record is read from the version 1 keys
-- (`keys.v1_lease`, and `keys.v1_grant` where the grant matters) when given, so leases held
-- before the upgrade stay held; the first write moves them (see write_record).
local function read_record(keys, now_ms)
  local key = keys.record
  local r = redis.pcall('HMGET', key, 'record_version', 'lease_id', 'owner', 'token',
    'acquired_ms', 'expires_ms', 'grant')
  if type(r) == 'table' and r.err then
    return false, read_error(r, 'record at ' .. key .. ' is not a hash')
  end
  if not r[1] then
    -- A hash holding none of our fields (or some of them without a version) is not ours to
    -- overwrite: corrupt, never free.
    if r[2] or r[3] or r[4] or r[5] or r[6] or r[7] or redis.call('EXISTS', key) == 1 then
      return false, corrupt('record at ' .. key .. ' lacks field record_version')
    end
    local rec = {exists = false}
    if keys.v1_lease then
      local v1 = v1_layout()
      local lease, err = v1.read_lease(keys.v1_lease, now_ms)
      if err then return false, err end
      if lease and lease.expires_ms > now_ms then rec.lease = lease end
      if keys.v1_grant then
        local grant, grant_err = v1.read_grant(keys.v1_grant)
        if grant_err then return false, grant_err end
        rec.grant = grant
      end
    end
    return rec
  end
  if r[1] ~= RECORD_VERSION then
    return false, corrupt('record at ' .. key .. ' has unknown record_version ' .. r[1])
  end
  local rec = {exists = true, grant = r[7] or nil}
  if r[2] or r[3] or r[4] or r[5] or r[6] then
    -- A lease is all five fields or none.
    for i = 2, 6 do
      if not r[i] or r[i] == '' then
        local names = {'lease_id', 'owner', 'token', 'acquired_ms', 'expires_ms'}
        return false, corrupt('record at ' .. key .. ' holds a lease that lacks field ' ..
          names[i - 1])
      end
    end
    local token, expires = arg_int(r[4]), arg_int(r[6])
    if not token or token == 0 then
      return false, corrupt('record at ' .. key .. ' has a non-numeric token or one above 2^53-1')
    end
    if not arg_int(r[5]) or not expires then
      return false, corrupt('record at ' .. key .. ' has a non-numeric acquired_ms or expires_ms')
    end
    -- No TTL is longer than MAX_TTL_MS: a lease ending later was not written by these scripts
    -- (or the server clock went back by more than an hour), and would otherwise be held for as
    -- long as it says.
    if expires > now_ms + MAX_TTL_MS + 3600000 then
      return false, corrupt('record at ' .. key .. ' holds a lease that ends more than 25 hours ' ..
        'from now (a lease lasts at most 24 hours)')
    end
    if expires > now_ms then
      rec.lease = {lease_id = r[2], owner = r[3], token = token, token_text = r[4],
        acquired_ms = r[5], expires_ms = expires}
    end
  end
  return rec
end

-- Writes the record's fields (names and values, as HSET takes them), creating the record from
-- the version 1 keys first when the target has none (see v1_layout().move).
local function write_record(keys, rec, now_ms, ...)
  if not rec.exists then v1_layout().move(keys, rec, now_ms) end
  if select('#', ...) > 0 then redis.call('HSET', keys.record, ...) end
end

-- Reads the fence: the newest token issued for the target (0 when absent). Returns the number,
-- or (false, error_reply).
local function read_fence(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' and v.err then
    return false, read_error(v, 'fence at ' .. key .. ' is not a string')
  end
  if not v then return 0 end
  local n = arg_int(v)
  if not n then
    return false, corrupt('fence at ' .. key .. ' is not a number from 0 to 2^53-1 ' ..
      '(targetlease lease repair resets it)')
  end
  return n
end

-- The reply cache makes a retried call with the same request id return the first reply without
-- acting again. Only replies of calls that changed state are cached; a refusal changed nothing,
-- so a retry of it simply asks again. An entry is `<binding> <reply>`, the binding being the
-- call's 40 hex digits: the same request id with other arguments (another caller, another
-- operation) is refused, never answered with someone else's reply. An entry version 1 wrote
-- (JSON, read with cjson) is still answered, so a retry across the upgrade gets its reply.
local function cached_reply(key, bound, op)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' and v.err then
    return false, read_error(v, 'reply cache at ' .. key .. ' is not a string')
  end
  if not v then return nil end
  local entry_binding, reply
  if string.sub(v, 1, 1) == '{' then
    local ok, entry = pcall(cjson.decode, v)
    if ok and type(entry) == 'table' and type(entry.r) == 'table' and #entry.r > 0 then
      reply = entry.r
      for i = 1, #reply do
        if type(reply[i]) ~= 'string' then reply = nil break end
      end
      if reply then entry_binding, reply = entry.b, table.concat(reply, ' ') end
    end
  elseif #v > 41 and string.match(string.sub(v, 1, 41), '^%x+ $') then
    entry_binding, reply = string.sub(v, 1, 40), string.sub(v, 42)
  end
  if not reply then
    return false, corrupt('reply cache at ' .. key .. ' is not a cached reply')
  end
  if entry_binding ~= bound then
    -- The operation whose reply starts with that outcome.
    local first = ({acquired = 'acquire', renewed = 'renew', released = 'release',
      committed = 'commit'})[string.match(reply, '^%S+')] or 'another operation'
    return false, invalid('request id already used for another call (' .. first ..
      ' with other arguments) on this target; a request id names one call and its retries: ' ..
      'use a new one for ' .. op)
  end
  return reply
end

local function remember(key, bound, reply, reply_ttl_ms)
  redis.call('SET', key, bound .. ' ' .. reply, 'PX', reply_ttl_ms)
  return reply
end

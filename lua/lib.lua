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
-- This prelude runs on every call (EVALSHA has no load-time code): every closure, table and
-- string built here is paid for by every call of every script, so keep it to what they share.

local RECORD_VERSION = '1'

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

-- The most permits a target may have (src/store/protocol.rs, MAX_PERMITS): an acquire reads
-- every slot, so the bound keeps the longest call short.
local MAX_PERMITS = 100

-- The longest lease TTL, 24 hours: what the client accepts (`Ttl`), checked again here for a
-- caller that goes around the client.
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

-- How far ahead of the server clock (in microseconds) every token is issued: one hour. Every
-- token is at least (server clock + MAX_LEAD) when it is issued, on every acquire, not only on a
-- target's first. A server that serves a target after others did (a promoted replica that
-- missed the newest grants, a restart from an older snapshot or without data) therefore issues
-- above every token they issued that no floor pushed further, as long as its clock is past
-- theirs at the moment they issued them: failovers take seconds, clocks agree to milliseconds.
local MAX_LEAD = 3600000000

-- How far ahead of the server clock a floor may be: the lead plus one hour, for a server whose
-- clock is behind the one that issued the floor's token (after a failover). A floor further
-- ahead did not come from a store. docs/store.md ("The token rule") says what is assumed of
-- clocks.
local MAX_FLOOR_LEAD = 7200000000

local function floor_too_far(min_token, now_us)
  return invalid('floor ' .. int(min_token) .. ' is more than two hours ahead of the server ' ..
    'clock (' .. int(now_us) .. ' microseconds): no token a store issues is that large, so it ' ..
    'came from another store, or from a server whose clock was more than an hour ahead of ' ..
    'this one')
end

-- The next token: above the fence, above the caller's floor, and at least the server clock in
-- microseconds plus MAX_LEAD. Returns the token, or (nil, error_reply) for a floor too far
-- ahead or a token that would pass MAX_TOKEN.
local function next_token(fence, min_token, now_us)
  if min_token > now_us + MAX_FLOOR_LEAD then return nil, floor_too_far(min_token, now_us) end
  local token = math.max(fence + 1, min_token + 1, now_us + MAX_LEAD)
  if token > MAX_TOKEN then return nil, exhausted(fence, min_token) end
  return token
end

-- Valkey keeps the writes a script made before an error, so the scripts order their writes so
-- that a refusal (an ACL rule without a command, a key pattern that misses a key) at any write
-- leaves nothing a later call reads as corrupt. The one pair that cannot be ordered so, a lease
-- hash and its expiry, is checked before the first write: `may_run(command, key, args...)`
-- answers the refusal the command would get, or nil.
local function may_run(...)
  if redis.acl_check_cmd(...) then return nil end
  local call = {...}
  return redis.error_reply('NOPERM this user has no permissions to run the \'' ..
    string.lower(call[1]) .. '\' command on ' .. call[2] .. ' (checked before any write)')
end

-- What a request id is bound to: the operation and every argument that identifies the call
-- (three, or four with `d`). Each part is length-prefixed, so no two different argument lists
-- give the same text; the text is the one earlier versions hashed, so their cached replies still
-- match. One concatenation, no table: this runs on every mutating call.
local function binding(op, a, b, c, d)
  local text = #op .. ':' .. op .. ',' .. #a .. ':' .. a .. ',' .. #b .. ':' .. b .. ',' ..
    #c .. ':' .. c
  if d then text = text .. ',' .. #d .. ':' .. d end
  return redis.sha1hex(text)
end

-- Reads the lease hash at `key`. Returns nil when there is no lease, the record table when it is
-- well formed, or (false, error_reply) when the key holds anything else. A lease without a TTL
-- (a restore or migration that dropped it, a PERSIST) is corrupt: it would never expire. The
-- record's `permits` is what it was granted under: absent for an exclusive lease (1), 2 to
-- MAX_PERMITS for a permit.
local function read_lease(key)
  -- EXISTS first: the free target (the hot path of acquire) costs one command, and a key that
  -- exists but holds none of our fields is corrupt, not free.
  if redis.call('EXISTS', key) == 0 then
    return nil
  end
  local r = redis.pcall('HMGET', key, 'record_version', 'lease_id', 'owner', 'token', 'acquired_ms',
    'permits')
  if type(r) == 'table' and r.err then
    return false, read_error(r, 'lease record at ' .. key .. ' is not a hash')
  end
  if not r[1] then
    return false, corrupt('lease record at ' .. key .. ' lacks field record_version')
  end
  if r[1] ~= RECORD_VERSION then
    return false, corrupt('lease record at ' .. key .. ' has unknown record_version ' .. r[1])
  end
  for i = 2, 5 do
    if not r[i] or r[i] == '' then
      local names = {'record_version', 'lease_id', 'owner', 'token', 'acquired_ms'}
      return false, corrupt('lease record at ' .. key .. ' lacks field ' .. names[i])
    end
  end
  local token = arg_int(r[4])
  if not token or token == 0 then
    return false, corrupt('lease record at ' .. key .. ' has a non-numeric token or one above 2^53-1')
  end
  if not arg_int(r[5]) then
    return false, corrupt('lease record at ' .. key .. ' has a non-numeric acquired_ms')
  end
  local permits = 1
  if r[6] then
    permits = arg_int(r[6])
    if not permits or permits < 2 or permits > MAX_PERMITS then
      return false, corrupt('lease record at ' .. key .. ' has permits that are not 2 to ' ..
        MAX_PERMITS)
    end
  end
  local pttl = redis.call('PTTL', key)
  if pttl < 0 then
    return false, corrupt('lease record at ' .. key .. ' has no expiry (a lease must expire)')
  end
  return {lease_id = r[2], owner = r[3], token = token, token_text = r[4], acquired_ms = r[5],
    pttl = pttl, permits = permits}
end

-- Reads a fence: the newest token granted in a slot (0 when absent). Slot 0's fence also carries,
-- once any other slot of the target was granted, `top`: the newest token of those, as
-- '<fence> <top>'. An exclusive acquire reads slot 0's fence anyway, so it learns from it at no
-- cost whether permits were ever granted on the target, and a client of a release before
-- permits cannot read it and fails closed there. Returns (fence, top or nil), or
-- (false, error_reply).
local function read_fence(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' and v.err then
    return false, read_error(v, 'fence at ' .. key .. ' is not a string')
  end
  if not v then return 0 end
  local n = arg_int(v)
  if n then return n end
  local fence_text, top_text = string.match(v, '^(%d+) (%d+)$')
  local fence, top = arg_int(fence_text), arg_int(top_text)
  if not fence or not top then
    return false, corrupt('fence at ' .. key .. ' is not a number from 0 to 2^53-1 ' ..
      '(targetlease lease repair resets it)')
  end
  return fence, top
end

-- Slot 0's fence as stored: the token, and `top` when there is one.
local function fence_text(token_text, top)
  if top then return token_text .. ' ' .. int(top) end
  return token_text
end

-- Reads the permits value in force: what the held permits of a target were granted under, kept
-- while any of them may be held (it expires after the last one). Returns nil when none is in
-- force, the number, or (false, error_reply).
local function read_permits(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' and v.err then
    return false, read_error(v, 'permits record at ' .. key .. ' is not a string')
  end
  if not v then return nil end
  local n = arg_int(v)
  if not n or n < 2 or n > MAX_PERMITS then
    return false, corrupt('permits record at ' .. key .. ' is not a number from 2 to ' ..
      MAX_PERMITS .. ' (targetlease lease repair deletes it)')
  end
  if redis.call('PTTL', key) < 0 then
    return false, corrupt('permits record at ' .. key .. ' has no expiry (it must expire ' ..
      'with the permits it stands for)')
  end
  return n
end

-- Keeps the permits value in force for at least `ttl_ms` more: written before the permit it
-- stands for, so no refused write can leave a permit held without it.
local function keep_permits(key, permits_text, ttl_ms)
  if redis.call('PTTL', key) < ttl_ms then
    redis.call('SET', key, permits_text, 'PX', ttl_ms)
  end
end

-- The reply cache makes a retried call with the same request id return the first reply without
-- acting again. Only replies of calls that changed state are cached; a refusal changed nothing,
-- so a retry of it simply asks again. An entry is `<binding> <reply>`, the binding being the
-- call's 40 hex digits: the same request id with other arguments (another caller, another
-- operation) is refused, never answered with someone else's reply. An entry an earlier version
-- wrote (JSON, read with cjson) is still answered, so a retry across an upgrade gets its reply.
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

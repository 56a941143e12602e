-- Shared prelude, prepended to every script at compile time (see src/store/valkey/scripts.rs).
-- Everything here is local: Valkey refuses scripts that create globals.
--
-- Records are validated on every read and anything unexpected fails closed with a `TLCORRUPT`
-- error: a record we cannot read is never mistaken for a free target.

local RECORD_VERSION = '1'

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

-- Parses a non-negative integer argument; nil when it is not one.
local function arg_int(s)
  local n = tonumber(s)
  if n == nil or n < 0 or n ~= math.floor(n) then return nil end
  return n
end

-- Server time from TIME, in microseconds and milliseconds.
local function server_now()
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  return us, math.floor(us / 1000)
end

-- Reads the lease hash at `key`. Returns nil when there is no lease, the record table when it is
-- well formed, or (false, error_reply) when the key holds anything else.
local function read_lease(key)
  -- EXISTS first: the free target (the hot path of acquire) costs one command, and a key that
  -- exists but holds none of our fields is corrupt, not free.
  if redis.call('EXISTS', key) == 0 then
    return nil
  end
  local r = redis.pcall('HMGET', key, 'record_version', 'lease_id', 'owner', 'token', 'acquired_ms')
  if type(r) == 'table' and r.err then
    return false, read_error(r, 'lease record at ' .. key .. ' is not a hash')
  end
  if not r[1] then
    return false, corrupt('lease record at ' .. key .. ' lacks field record_version')
  end
  if r[1] ~= RECORD_VERSION then
    return false, corrupt('lease record at ' .. key .. ' has unknown record_version ' .. tostring(r[1]))
  end
  for i = 2, 5 do
    if not r[i] or r[i] == '' then
      local names = {'record_version', 'lease_id', 'owner', 'token', 'acquired_ms'}
      return false, corrupt('lease record at ' .. key .. ' lacks field ' .. names[i])
    end
  end
  local token = arg_int(r[4])
  if not token or token == 0 then
    return false, corrupt('lease record at ' .. key .. ' has a non-numeric token')
  end
  if not arg_int(r[5]) then
    return false, corrupt('lease record at ' .. key .. ' has a non-numeric acquired_ms')
  end
  return {lease_id = r[2], owner = r[3], token = r[4], acquired_ms = r[5]}
end

-- Reads the fencing high-water mark (0 when absent). Returns (number) or (false, error_reply).
local function read_fence(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' and v.err then
    return false, read_error(v, 'fence at ' .. key .. ' is not a string')
  end
  if not v then return 0 end
  local n = arg_int(v)
  if not n then
    return false, corrupt('fence at ' .. key .. ' is not a number')
  end
  return n
end

-- The reply cache makes a retried call with the same request id return the first reply without
-- acting again. Only replies of calls that changed state are cached; a refusal changed nothing,
-- so a retry of it simply asks again.
local function cached_reply(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' and v.err then
    return false, read_error(v, 'reply cache at ' .. key .. ' is not a string')
  end
  if not v then return nil end
  local ok, reply = pcall(cjson.decode, v)
  if not ok or type(reply) ~= 'table' or type(reply[1]) ~= 'string' then
    return false, corrupt('reply cache at ' .. key .. ' is not a cached reply')
  end
  return reply
end

-- Every element of a reply is a string, so the cjson round trip cannot round numbers.
local function remember(key, reply, reply_ttl_ms)
  redis.call('SET', key, cjson.encode(reply), 'PX', reply_ttl_ms)
  return reply
end

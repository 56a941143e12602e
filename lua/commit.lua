-- commit: the downstream fencing check for data kept in Valkey. Writes `value` to the guarded
-- record only when `token` is not older than the newest token issued for the target, nor older
-- than the token of the last accepted write.
-- KEYS[1] fence   KEYS[2] guarded record (hash: token, value)   KEYS[3] reply cache
-- ARGV[1] token  ARGV[2] value  ARGV[3] reply_ttl_ms
-- Reply: {'committed', token} | {'stale', newest_token}
local cached, err = cached_reply(KEYS[3])
if cached then return cached elseif err then return err end

local token, reply_ttl = arg_int(ARGV[1]), arg_int(ARGV[3])
if not token or token == 0 then return invalid('token must be a positive integer') end
if not reply_ttl or reply_ttl < 1 then return invalid('reply_ttl_ms must be a positive integer') end

local fence, fence_err = read_fence(KEYS[1])
if fence_err then return fence_err end
if token < fence then return {'stale', int(fence)} end

local last = redis.pcall('HGET', KEYS[2], 'token')
if type(last) == 'table' and last.err then return read_error(last, 'guarded record at ' .. KEYS[2] .. ' is not a hash') end
if last then
  local last_token = arg_int(last)
  if not last_token then return corrupt('guarded record at ' .. KEYS[2] .. ' has a non-numeric token') end
  if token < last_token then return {'stale', int(last_token)} end
end
redis.call('HSET', KEYS[2], 'token', int(token), 'value', ARGV[2])
return remember(KEYS[3], {'committed', int(token)}, reply_ttl)

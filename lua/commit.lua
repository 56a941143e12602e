-- commit: the downstream fencing check for data kept in Valkey. Writes `value` to the guarded
-- record only with the newest token issued for the target (an older one is stale, a larger one
-- was never issued), and only when (token, sequence) is above the last accepted write's: within
-- one tenure the writer numbers its writes, so a late replay of an earlier write can never roll
-- the record back. The same (token, sequence) with the same value is answered `committed`
-- without writing again, so a retry is harmless even after its cached reply expired.
-- KEYS: fence, guarded, commit_reply
--   the fence (newest token); the guarded record (hash: token, sequence, value); the reply cache
--   of this request id (under :commit-req:, writable by the workload ACL user)
-- ARGV: token, value, reply_ttl_ms, sequence, key
--   key: the guarded record's name (bound into the request id)
-- Reply: 'committed <token>' | 'stale <newest_token>'
local token, reply_ttl, sequence = arg_int(ARGV[1]), arg_int(ARGV[3]), arg_int(ARGV[4])
if not token or token == 0 then return invalid('token must be an integer from 1 to 2^53-1') end
if not reply_ttl or reply_ttl < 1 then return invalid('reply_ttl_ms must be a positive integer') end
if not sequence then return invalid('sequence must be an integer from 0 to 2^53-1') end

local bound = binding('commit', ARGV[1], ARGV[5], ARGV[4], redis.sha1hex(ARGV[2]))
local cached, err = cached_reply(KEYS[3], bound, 'commit')
if cached then return cached elseif err then return err end

local fence, fence_err = read_fence(KEYS[1])
if not fence then return fence_err end
if token < fence then return 'stale ' .. int(fence) end
if token > fence then
  return invalid('token ' .. ARGV[1] .. ' was never issued for this target (the newest is ' ..
    int(fence) .. '; 0 means none, or the store lost its data)')
end

local last = redis.pcall('HMGET', KEYS[2], 'token', 'sequence', 'value')
if type(last) == 'table' and last.err then return read_error(last, 'guarded record at ' .. KEYS[2] .. ' is not a hash') end
if last[1] then
  local last_token, last_sequence = arg_int(last[1]), arg_int(last[2] or '0')
  if not last_token or not last_sequence or not last[3] then
    return corrupt('guarded record at ' .. KEYS[2] .. ' has a non-numeric token or sequence')
  end
  if token < last_token or (token == last_token and sequence < last_sequence) then
    return 'stale ' .. int(last_token)
  end
  if token == last_token and sequence == last_sequence then
    if last[3] ~= ARGV[2] then return 'stale ' .. int(last_token) end
    -- This very write is already there: answer as the first call did, write nothing.
    return remember(KEYS[3], bound, 'committed ' .. ARGV[1], reply_ttl)
  end
end
redis.call('HSET', KEYS[2], 'token', int(token), 'sequence', int(sequence), 'value', ARGV[2])
return remember(KEYS[3], bound, 'committed ' .. ARGV[1], reply_ttl)

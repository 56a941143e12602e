-- check: read-only fencing check; is `token` the newest token issued for the target?
-- KEYS[1] fence
-- ARGV[1] token
-- Reply: {'current', newest_token} | {'stale', newest_token}
local token = arg_int(ARGV[1])
if not token or token == 0 then return invalid('token must be a positive integer') end
local fence, fence_err = read_fence(KEYS[1])
if fence_err then return fence_err end
if token < fence then return {'stale', int(fence)} end
return {'current', int(math.max(fence, token))}

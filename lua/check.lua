-- check: read-only fencing check; is `token` the newest token issued for the target? A token
-- above the newest was never issued (a typo, another target's token, or lost data): refused.
-- KEYS: fence
-- ARGV: token
-- Reply: 'current <newest_token>' | 'stale <newest_token>'
local token = arg_int(ARGV[1])
if not token or token == 0 then return invalid('token must be an integer from 1 to 2^53-1') end
local fence, fence_err = read_fence(KEYS[1])
if not fence then return fence_err end
if token < fence then return 'stale ' .. int(fence) end
if token > fence then
  return invalid('token ' .. ARGV[1] .. ' was never issued for this target (the newest is ' ..
    int(fence) .. '; 0 means none, or the store lost its data)')
end
-- ARGV[1] is canonical once arg_int accepted it, and equal to the fence.
return 'current ' .. ARGV[1]

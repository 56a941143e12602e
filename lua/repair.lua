-- repair: the operator's way out of a record that fails closed. A lease record that cannot be
-- read is deleted (nobody can renew it anyway); a fence that is not a token is replaced by the
-- largest of the operator's floor, the readable lease token and the server clock in
-- microseconds plus MAX_LEAD (where every new token starts), so the next token is
-- still above every token this store could have issued; a grant record that is not a string
-- is deleted (it only names the request id of the newest grant, so that a replay of it is
-- refused once its cached reply expired; an unreadable one fails every grant). Readable records
-- are left alone.
-- KEYS: lease, fence, grant
-- ARGV: floor
-- Reply: 'intact <fence>' | 'repaired <fence> <what>'
local floor = arg_int(ARGV[1])
if not floor or floor >= MAX_TOKEN then return invalid('floor must be an integer from 0 to 2^53-2') end
local repaired = {}
local lease_token = 0
-- Everything is read first and written last: a script refused at a write (an ACL rule without
-- SET) has then deleted nothing the operator's floor was meant to replace.
local lease, lease_err = read_lease(KEYS[1])
if lease_err then
  if not string.find(lease_err.err, 'TLCORRUPT', 1, true) then return lease_err end
elseif lease then
  lease_token = lease.token
end
local grant = redis.pcall('GET', KEYS[3])
local grant_unreadable = type(grant) == 'table' and grant.err
if grant_unreadable then
  local grant_err = read_error(grant, 'grant record at ' .. KEYS[3] .. ' is not a string')
  if not string.find(grant_err.err, 'TLCORRUPT', 1, true) then return grant_err end
end
local fence, fence_err = read_fence(KEYS[2])
if not fence then
  if not string.find(fence_err.err, 'TLCORRUPT', 1, true) then return fence_err end
  local now_us = server_now()
  if floor > now_us + MAX_FLOOR_LEAD then return floor_too_far(floor, now_us) end
  fence = math.max(floor, lease_token, now_us + MAX_LEAD)
  -- SET replaces a value of any type: no DEL first.
  redis.call('SET', KEYS[2], int(fence))
  table.insert(repaired, 'reset the fence')
end
if grant_unreadable then
  redis.call('DEL', KEYS[3])
  table.insert(repaired, 'deleted the unreadable grant record')
end
if lease_err then
  redis.call('DEL', KEYS[1])
  table.insert(repaired, 1, 'deleted the unreadable lease record')
end
if #repaired == 0 then return 'intact ' .. int(fence) end
return 'repaired ' .. int(fence) .. ' ' .. table.concat(repaired, '; ')

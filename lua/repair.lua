-- repair: the operator's way out of a record that fails closed. A target record or a version 1
-- lease record that cannot be read is deleted (nobody can renew it anyway; a deleted record
-- also forgets the newest grant's request id); a fence that is not a token is replaced by the
-- largest of the operator's floor, the readable lease token and the server clock in
-- microseconds plus MAX_LEAD (where a target without a fence starts), so the next token is
-- still above every token this store could have issued. Readable records are left alone.
-- KEYS: record, fence, v1_lease, v1_grant
-- ARGV: floor
-- Reply: 'intact <fence>' | 'repaired <fence> <what>'
local floor = arg_int(ARGV[1])
if not floor or floor >= MAX_TOKEN then return invalid('floor must be an integer from 0 to 2^53-2') end
local repaired = {}
local now_us, now_ms = server_now()

-- Deletes `key` when `err` says it is corrupt; passes any other error on.
local function drop_if_corrupt(err, key, what)
  if not string.find(err.err, 'TLCORRUPT', 1, true) then return err end
  redis.call('DEL', key)
  table.insert(repaired, 'deleted the unreadable ' .. what)
end

-- The record alone first: an unreadable record is deleted without touching the version 1 keys,
-- which then say who holds the target (the moved marker: nobody).
local rec, rec_err = read_record({record = KEYS[1]}, now_ms)
if not rec then
  local other = drop_if_corrupt(rec_err, KEYS[1], 'target record')
  if other then return other end
  rec = {exists = false}
end
local lease_token = 0
if rec.exists then
  if rec.lease then lease_token = rec.lease.token end
else
  local lease, lease_err = v1_layout().read_lease(KEYS[3], now_ms)
  if lease_err then
    local other = drop_if_corrupt(lease_err, KEYS[3], 'version 1 lease record')
    if other then return other end
  elseif lease then
    lease_token = lease.token
  end
  local grant = redis.pcall('GET', KEYS[4])
  if type(grant) == 'table' and grant.err then
    local other = drop_if_corrupt(read_error(grant, 'version 1 grant record at ' .. KEYS[4] ..
      ' is not a string'), KEYS[4], 'version 1 grant record')
    if other then return other end
  end
end
local fence, fence_err = read_fence(KEYS[2])
if not fence then
  if not string.find(fence_err.err, 'TLCORRUPT', 1, true) then return fence_err end
  if floor > now_us + MAX_LEAD then
    return invalid('floor ' .. int(floor) .. ' is more than an hour ahead of the server clock (' ..
      int(now_us) .. ' microseconds): no token this store issues is that large')
  end
  fence = math.max(floor, lease_token, now_us + MAX_LEAD)
  redis.call('DEL', KEYS[2])
  redis.call('SET', KEYS[2], int(fence))
  table.insert(repaired, 'reset the fence')
end
if #repaired == 0 then return 'intact ' .. int(fence) end
return 'repaired ' .. int(fence) .. ' ' .. table.concat(repaired, '; ')

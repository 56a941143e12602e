-- repair: the operator's way out of a record that fails closed. A target record or a version 1
-- lease record that cannot be read is deleted (nobody can renew it anyway; a deleted record
-- also forgets the newest grant's request id); a fence that is not a token is replaced by the
-- largest of the operator's floor, the readable lease token and the server clock in
-- microseconds plus MAX_LEAD (where a target without a fence starts), so the next token is
-- still above every token this store could have issued. Beside a record, a missing or
-- unreadable moved marker (a restore that dropped its TTL, a deleted key) is written again, so
-- version 1 clients stay refused; a live version 1 lease beside a record (a version 1 client
-- granted the target after the move) is refused, never chosen between. Readable records are
-- left alone.
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
local v1 = v1_layout()
local lease, lease_err = v1.read_lease(KEYS[3], now_ms)
if rec.exists then
  if rec.lease then lease_token = rec.lease.token end
  if lease then
    return corrupt('version 1 lease record at ' .. KEYS[3] .. ' (owner ' .. lease.owner .. ') ' ..
      'holds the target beside the record at ' .. KEYS[1] .. ': a version 1 client granted it ' ..
      'after the move. Stop version 1 clients, delete ' .. KEYS[3] .. ' and repair again')
  end
  -- PTTL: -2 without the key, -1 for a marker a restore left without its TTL (version 1 reads
  -- that as corrupt, and its repair would delete it).
  if lease_err or redis.call('PTTL', KEYS[3]) < 0 then
    if lease_err and not string.find(lease_err.err, 'TLCORRUPT', 1, true) then return lease_err end
    v1.write_marker({record = KEYS[1], reply = 'repair ' .. int(now_us), v1_lease = KEYS[3]}, now_ms)
    table.insert(repaired, 'wrote the version 1 marker again')
  end
else
  if lease_err then
    local other = drop_if_corrupt(lease_err, KEYS[3], 'version 1 lease record')
    if other then return other end
  elseif lease then
    lease_token = lease.token
  end
  local _, grant_err = v1.read_grant(KEYS[4])
  if grant_err then
    local other = drop_if_corrupt(grant_err, KEYS[4], 'version 1 grant record')
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

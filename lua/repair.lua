-- repair: the operator's way out of a record that fails closed, in any slot. A lease record that
-- cannot be read is deleted (nobody can renew it anyway); a fence that is not a token
-- is replaced by the largest of the operator's floor, the readable lease token and the server
-- clock in microseconds plus MAX_LEAD (where every new token starts), so the next token is
-- still above every token this store could have issued; a grant record that is not a string
-- is deleted (it only names the request id of a slot's newest grant, so that a replay of it is
-- refused once its cached reply expired; an unreadable one fails every grant); an unreadable
-- permits value is rewritten from the readable leases that were granted under one (their
-- largest value, kept as long as the longest of them), or deleted when none is held. Readable
-- records are left alone.
-- KEYS: lease, fence, grant, permits
-- KEYS per further slot: slot_lease, slot_fence, slot_grant
--   slot 0's lease hash, fence (with the newest token of slots from 1) and grant record; the
--   permits value in force; then the same three for slots 1 and up (as many as the largest
--   permits)
-- ARGV: floor
-- Reply: 'intact <fence>' | 'repaired <fence> <what>' (the newest token of the target)
local floor = arg_int(ARGV[1])
if not floor or floor >= MAX_TOKEN then return invalid('floor must be an integer from 0 to 2^53-2') end
local function slot_key(s, i)
  if s == 0 then return KEYS[i] end
  return KEYS[4 + 3 * (s - 1) + i]
end
-- Only unreadable records are repaired: any other failure (an ACL refusal, ...) is answered.
local function tolerate(err)
  return not string.find(err.err, 'TLCORRUPT', 1, true)
end
-- Everything is read first and written last: a script refused at a write (an ACL rule without
-- SET) has then deleted nothing the operator's floor was meant to replace.
local slots = (#KEYS - 4) / 3 + 1
local bad_leases, bad_fences, bad_grants = {}, {}, {}
local highest_token, held_permits, held_pttl = 0, nil, 0
local newest, fence0, top, permits_used = 0, nil, nil, false
for s = 0, slots - 1 do
  local lease, lease_err = read_lease(slot_key(s, 1))
  if lease_err then
    if tolerate(lease_err) then return lease_err end
    table.insert(bad_leases, s)
  elseif lease then
    highest_token = math.max(highest_token, lease.token)
    if s > 0 then permits_used = true end
    if lease.permits > 1 then
      held_permits = math.max(held_permits or 0, lease.permits)
      held_pttl = math.max(held_pttl, lease.pttl)
    end
  end
  local fence, extra = read_fence(slot_key(s, 2))
  if not fence then
    if tolerate(extra) then return extra end
    table.insert(bad_fences, s)
  else
    newest = math.max(newest, fence, extra or 0)
    if s == 0 then fence0, top = fence, extra end
    if s > 0 and fence > 0 then permits_used = true end
  end
  local grant = redis.pcall('GET', slot_key(s, 3))
  if type(grant) == 'table' and grant.err then
    local grant_err = read_error(grant, 'grant record at ' .. slot_key(s, 3) .. ' is not a string')
    if tolerate(grant_err) then return grant_err end
    table.insert(bad_grants, s)
  end
end
local in_force, permits_err = read_permits(KEYS[4])
if in_force == false then
  if tolerate(permits_err) then return permits_err end
end
if in_force ~= nil or held_permits then permits_used = true end

local repaired = {}
local function slots_named(list)
  -- Slot 0 alone is the exclusive lease's record: named as it always was.
  if #list == 1 and list[1] == 0 then return '' end
  local names = {}
  for _, s in ipairs(list) do table.insert(names, int(s)) end
  return ' (slot ' .. table.concat(names, ', ') .. ')'
end
if #bad_fences > 0 then
  local now_us = server_now()
  if floor > now_us + MAX_FLOOR_LEAD then return floor_too_far(floor, now_us) end
  local reset = math.max(floor, highest_token, now_us + MAX_LEAD)
  newest = math.max(newest, reset)
  -- SET replaces a value of any type: no DEL first.
  for _, s in ipairs(bad_fences) do
    if s == 0 and permits_used then
      -- Slot 0's fence carries the newest token of the other slots: reset it too, so that
      -- every later grant, exclusive ones included, is above them.
      redis.call('SET', slot_key(s, 2), int(reset) .. ' ' .. int(reset))
    else
      redis.call('SET', slot_key(s, 2), int(reset))
    end
  end
  -- Slot 0's fence keeps the newest token of the other slots: a reset one is raised there too,
  -- so the next grant of any slot is above it.
  if fence0 and permits_used and (top or 0) < reset then
    redis.call('SET', KEYS[2], int(fence0) .. ' ' .. int(reset))
  end
  table.insert(repaired, 'reset the fence' .. slots_named(bad_fences))
end
if #bad_grants > 0 then
  for _, s in ipairs(bad_grants) do redis.call('DEL', slot_key(s, 3)) end
  table.insert(repaired, 'deleted the unreadable grant record' .. slots_named(bad_grants))
end
if in_force == false then
  if held_permits then
    redis.call('SET', KEYS[4], int(held_permits), 'PX', held_pttl)
    table.insert(repaired, 'rewrote the unreadable permits record from the held permits')
  else
    redis.call('DEL', KEYS[4])
    table.insert(repaired, 'deleted the unreadable permits record')
  end
end
if #bad_leases > 0 then
  for _, s in ipairs(bad_leases) do redis.call('DEL', slot_key(s, 1)) end
  table.insert(repaired, 1, 'deleted the unreadable lease record' .. slots_named(bad_leases))
end
if #repaired == 0 then return 'intact ' .. int(newest) end
return 'repaired ' .. int(newest) .. ' ' .. table.concat(repaired, '; ')

-- read: the guarded record written by fenced commits.
-- KEYS: guarded
--   the guarded record (hash: token, sequence, value)
-- ARGV: (none)
-- Reply: 'absent' | 'present <token> <value>'
local r = redis.pcall('HMGET', KEYS[1], 'token', 'value')
if type(r) == 'table' and r.err then return read_error(r, 'guarded record at ' .. KEYS[1] .. ' is not a hash') end
if not r[1] and not r[2] then return 'absent' end
if not arg_int(r[1]) or not r[2] then
  return corrupt('guarded record at ' .. KEYS[1] .. ' is incomplete or has a non-numeric token')
end
return 'present ' .. r[1] .. ' ' .. r[2]

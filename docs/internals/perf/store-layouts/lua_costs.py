# What single Lua constructs and redis.call()s cost inside a script: each body runs 10 times per
# EVALSHA, 20,000 pipelined calls, best of 3, minus an empty body. Usage: python3 lua_costs.py PORT
import valkey, sys, uuid
port = int(sys.argv[1]); N = 20000
r = valkey.Valkey(port=port)
def cpu():
    i = r.info('cpu'); return i['used_cpu_user'] + i['used_cpu_sys']
r.flushall()
r.hset('h', mapping={'record_version':'2','lease_id':'lease-1234567890','owner':'owner-1','token':'1764000000000000','acquired_ms':'1764000000000','expires_ms':'1764000000000','grant':'abcdef0123456789abcdef0123456789'})
r.set('s', '1764000000000000')
base = None
def m(name, body, reps=10):
    global base
    sha = r.script_load(f"for i = 1, {reps} do\n{body}\nend\nreturn 1")
    best = 1e9
    for rnd in range(3):
        c0 = cpu(); p = r.pipeline(transaction=False)
        for i in range(N): p.execute_command('EVALSHA', sha, 2, 'h', 's', 'lease-1234567890', 'owner-1', '30000', '0', '60000', uuid.uuid4().hex)
        p.execute(); c1 = cpu(); best = min(best, (c1-c0)*1e6/N)
    if base is None: base = best
    print(f'{name:55s} {(best-base)/reps:6.3f} us each')
m('nothing', "local x = 1")
m('string.format %.0f', "local x = string.format('%.0f', 1764000000000001 + i)")
m('tostring 13 digits', "local x = tostring(1764000000000 + i)")
m('concat number..""', "local x = (1764000000000 + i) .. ''")
m('table of 5 strings', "local t = {'a', ARGV[1], 'b', ARGV[2], 'c'}")
m('closure', "local f = function(x) return x end")
m('sha1hex 80B', "local x = redis.sha1hex(ARGV[1] .. ARGV[2] .. ARGV[6] .. ARGV[1] .. ARGV[2])")
m('binding as lib (table+loop+concat+sha1)', "local parts = {'acquire', ARGV[1], ARGV[2], ARGV[4]}; for j = 1, #parts do parts[j] = #parts[j] .. ':' .. parts[j] end; local b = redis.sha1hex(table.concat(parts, ','))")
m('binding as one concat + sha1', "local b = redis.sha1hex('7:acquire,' .. #ARGV[1] .. ':' .. ARGV[1] .. ',' .. #ARGV[2] .. ':' .. ARGV[2] .. ',' .. #ARGV[4] .. ':' .. ARGV[4])")
m('arg_int (match+tonumber)', "local s = ARGV[3]; local n = nil; if #s <= 16 and (s == '0' or string.match(s, '^[1-9]%d*$')) then n = tonumber(s) end")
m('redis.call TIME', "local t = redis.call('TIME')")
m('redis.call GET', "local t = redis.call('GET', KEYS[2])")
m('redis.pcall GET', "local t = redis.pcall('GET', KEYS[2])")
m('redis.call HMGET 7', "local t = redis.call('HMGET', KEYS[1], 'record_version', 'lease_id', 'owner', 'token', 'acquired_ms', 'expires_ms', 'grant')")
m('redis.call HGETALL (7)', "local t = redis.call('HGETALL', KEYS[1])")
m('redis.call HSET 5 fields', "redis.call('HSET', KEYS[1], 'lease_id', ARGV[1], 'owner', ARGV[2], 'token', '1764000000000000', 'expires_ms', '1764000000000', 'grant', ARGV[6])")
m('redis.call HSET 5 fields via unpack', "local f = {'lease_id', ARGV[1], 'owner', ARGV[2], 'token', '1764000000000000', 'expires_ms', '1764000000000', 'grant', ARGV[6]}; redis.call('HSET', KEYS[1], unpack(f))")
m('redis.call SET', "redis.call('SET', KEYS[2], '1764000000000000')")
m('redis.call SET PX new key', "redis.call('SET', 'q:' .. ARGV[6] .. i, 'x', 'PX', 60000)")
m('string.match reply', "local x = string.match('acquired 1764000000000000 30000 1 1', '^acquired (%d+) ')")
# What a reply costs: the same answer as a Lua table of five strings and as one string, one
# script call each (minus `return 1`).
def whole(name, body):
    sha = r.script_load(body)
    best = 1e9
    for rnd in range(3):
        c0 = cpu(); p = r.pipeline(transaction=False)
        for i in range(N): p.execute_command('EVALSHA', sha, 2, 'h', 's', 'lease-1234567890', 'owner-1', '30000', '0', '60000', uuid.uuid4().hex)
        p.execute(); best = min(best, (cpu() - c0) * 1e6 / N)
    return best
one = whole('return 1', "return 1")
for name, body in (('reply as a table of 5 strings', "return {'acquired', '1796121195530348', '30000', '1796117611014', '1796117610329'}"),
                   ('reply as one string', "return 'acquired 1796121195530348 30000 1796117611014 1796117610329'")):
    print(f'{name:55s} {whole(name, body) - one:6.3f} us more than return 1')
# What the shared prelude (lua/lib.lua) costs every call of every script.
import pathlib
lib = (pathlib.Path(__file__).resolve().parents[4] / 'lua' / 'lib.lua').read_text()
print(f"{'lua/lib.lua before return 1':55s} {whole('prelude', lib + chr(10) + 'return 1') - one:6.3f} us more than return 1")

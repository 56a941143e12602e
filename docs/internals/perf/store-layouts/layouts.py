# Prototype store layouts, server CPU per acquire+release cycle (pipelined, INFO cpu):
# the baselines b and f, a one-record layout without a reply cache, with reply-cache keys, with
# reply-cache fields under field expiry (HSETEX, Valkey >= 9.0 only), each as EVALSHA and as FCALL,
# and layout version 1's own scripts. Usage: python3 layouts.py PORT [N]  (a server on 127.0.0.1:PORT;
# the PyPI package `valkey` as client). Output of the runs quoted in docs/internals/performance.md: *.txt.
import valkey, sys, uuid, time
port = int(sys.argv[1]); N = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
r = valkey.Valkey(port=port)
def cpu():
    i = r.info('cpu'); return i['used_cpu_user'] + i['used_cpu_sys']
ACQ = r'''
local rid = ARGV[6]; local RTTL = ARGV[5]
local r = redis.call('HMGET', KEYS[1], 'v', 'lease_id', 'owner', 'token', 'acquired_ms', 'expires_ms', 'grant', 'q:' .. rid)
local bound = ARGV[1] .. '\0' .. ARGV[2] .. '\0' .. ARGV[4]
if r[8] then return {'memo', r[8]} end
local t = redis.call('TIME')
local now_ms = math.floor((tonumber(t[1]) * 1000000 + tonumber(t[2])) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
if r[1] and tonumber(r[6]) > now_ms then
  if r[2] ~= ARGV[1] or r[3] ~= ARGV[2] then return {'held', r[3], string.format('%.0f', tonumber(r[6]) - now_ms)} end
end
local fence = tonumber(redis.call('GET', KEYS[2]) or '0')
local token = string.format('%.0f', math.max(fence + 1, tonumber(ARGV[4]) + 1, now_us))
local ttl = tonumber(ARGV[3])
local now = string.format('%.0f', now_ms)
redis.call('HSET', KEYS[1], 'v', '2', 'lease_id', ARGV[1], 'owner', ARGV[2], 'token', token, 'acquired_ms', now, 'expires_ms', string.format('%.0f', now_ms + ttl), 'grant', rid)
redis.call('SET', KEYS[2], token)
local reply = {'acquired', token, ARGV[3], now, now}
MEMO
return reply
'''
REL = r'''
local rid = ARGV[5]; local RTTL = ARGV[4]
local r = redis.call('HMGET', KEYS[1], 'v', 'lease_id', 'owner', 'token', 'expires_ms', 'q:' .. rid)
if r[6] then return {'memo', r[6]} end
local t = redis.call('TIME')
local now_ms = math.floor((tonumber(t[1]) * 1000000 + tonumber(t[2])) / 1000)
if not r[1] or tonumber(r[5]) <= now_ms or r[2] ~= ARGV[1] or r[3] ~= ARGV[2] or r[4] ~= ARGV[3] then return {'not_holder'} end
redis.call('HSET', KEYS[1], 'expires_ms', '0')
local reply = {'released'}
MEMO
return reply
'''
MEMO_FIELD = "redis.call('HSETEX', KEYS[1], 'PX', RTTL, 'FIELDS', 1, 'q:' .. rid, table.concat(reply, '\\t'))"
MEMO_KEY = "redis.call('SET', KEYS[1] .. ':q:' .. rid, table.concat(reply, '\\t'), 'PX', RTTL)"
MEMO_NONE = ""
def run(name, acq, rel, mode, extra=None):
    r.flushall()
    if mode == 'fcall':
        lib = "#!lua name=proto\nredis.register_function('acq', function(KEYS, ARGV)\n" + acq + "\nend)\nredis.register_function('rel', function(KEYS, ARGV)\n" + rel + "\nend)\n"
        r.execute_command('FUNCTION', 'LOAD', 'REPLACE', lib)
        ca = lambda p, keys, args: p.execute_command('FCALL', 'acq', len(keys), *keys, *args)
        cr = lambda p, keys, args: p.execute_command('FCALL', 'rel', len(keys), *keys, *args)
    else:
        sa = r.script_load(acq); sr = r.script_load(rel)
        ca = lambda p, keys, args: p.execute_command('EVALSHA', sa, len(keys), *keys, *args)
        cr = lambda p, keys, args: p.execute_command('EVALSHA', sr, len(keys), *keys, *args)
    # warm: acquire+release per target, n targets, 2 rounds
    tot = 0; calls = 0
    for rnd in range(3):
        c0 = cpu()
        p = r.pipeline(transaction=False)
        for i in range(N):
            k = [f'tl:{{b/t{i}}}', f'tl:{{b/t{i}}}:fence']
            ca(p, k, [f'lease-{i}', f'o{i}', '30000', '0', '60000', uuid.uuid4().hex])
        res = p.execute(raise_on_error=False)
        p = r.pipeline(transaction=False)
        for i, x in enumerate(res):
            k = [f'tl:{{b/t{i}}}', f'tl:{{b/t{i}}}:fence']
            cr(p, k, [f'lease-{i}', f'o{i}', x[1].decode(), '60000', uuid.uuid4().hex])
        res2 = p.execute(raise_on_error=False)
        c1 = cpu()
        assert all(y[0] == b'released' for y in res2), (res[:2], res2[:2])
        if rnd > 0: tot += c1 - c0; calls += N
    mem = r.info('memory')['used_memory']
    print(f'{name:40s} {tot*1e6/calls:6.2f} us/cycle  mem/target {mem/N:7.0f} B')
def baselines():
    r.flushall()
    f = r.script_load("if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return redis.call('INCR', KEYS[2]) else return 0 end")
    u = r.script_load("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end")
    for name, fenced in (('b redlock', False), ('f fenced', True)):
        tot=0
        for rnd in range(3):
            c0 = cpu(); p = r.pipeline(transaction=False)
            for i in range(N):
                if fenced: p.execute_command('EVALSHA', f, 2, f'l{i}', f'fe{i}', f'v{i}', 30000)
                else: p.execute_command('SET', f'l{i}', f'v{i}', 'NX', 'PX', 30000)
            p.execute()
            p = r.pipeline(transaction=False)
            for i in range(N): p.execute_command('EVALSHA', u, 1, f'l{i}', f'v{i}')
            p.execute(); c1 = cpu()
            if rnd: tot += c1-c0
        print(f'{name:40s} {tot*1e6/(2*N):6.2f} us/cycle')
baselines()
for mode in ('evalsha', 'fcall'):
    for mname, memo in (('nomemo', MEMO_NONE), ('memo-key', MEMO_KEY)) + ((('memo-field', MEMO_FIELD),) if port == 7701 else ()):
        run(f'{mode} {mname}', ACQ.replace('MEMO', memo), REL.replace('MEMO', memo), mode)
# The shipped scripts, the previous release's (tests/fixtures/lua-v1) against this one's (lua/), in the
# same process: server CPU per steady-state cycle (targets released before, as in workload a) and
# used_memory per target while held, after release, and once the reply caches are gone.
import pathlib
ROOT = pathlib.Path(__file__).resolve().parents[4]
def scripts(folder):
    lib = (ROOT / folder / 'lib.lua').read_text()
    return [r.script_load(lib + '\n' + (ROOT / folder / f).read_text()) for f in ('acquire.lua', 'release.lua')]
def mem():
    return r.info('memory')['used_memory']
for name, folder in (('previous release (tests/fixtures/lua-v1)', 'tests/fixtures/lua-v1'), ('this release (lua/)', 'lua')):
    r.execute_command('FLUSHALL', 'SYNC')
    acq, rel = scripts(folder)
    def keys(i, rid, op):
        b = f'tl:{{b/t{i}}}'
        return ([b+':lease', b+':fence', b+':req:'+rid, b+':grant'] if op == 'acquire'
                else [b+':lease', b+':req:'+rid])
    tot = 0
    for rnd in range(4):
        m0 = mem(); c0 = cpu(); p = r.pipeline(transaction=False)
        rids = [uuid.uuid4().hex for i in range(N)]
        for i in range(N):
            k = keys(i, rids[i], 'acquire')
            p.execute_command('EVALSHA', acq, len(k), *k, f'lease-{i}', f'o{i}', 30000, 0, 60000, rids[i])
        res = p.execute()
        m1 = mem()
        p = r.pipeline(transaction=False)
        for i in range(N):
            q = uuid.uuid4().hex; k = keys(i, q, 'release')
            token = res[i][1] if isinstance(res[i], list) else res[i].split()[1]
            p.execute_command('EVALSHA', rel, len(k), *k, f'lease-{i}', f'o{i}', token, 60000)
        res2 = p.execute(); c1 = cpu(); m2 = mem()
        first = res2[0][0] if isinstance(res2[0], list) else res2[0]
        assert first == b'released', res2[0]
        if rnd: tot += c1 - c0
        if rnd == 0:
            m_empty = m0; m_held = m1; m_released = m2
    for k in r.scan_iter(match='tl:*:req:*', count=1000):
        r.delete(k)
    m_settled = mem()
    print(f'{name:40s} {tot*1e6/(3*N):6.2f} us/cycle; bytes per target: held {(m_held-m_empty)/N:.0f}, '
          f'released {(m_released-m_empty)/N:.0f}, without reply caches {(m_settled-m_empty)/N:.0f}')

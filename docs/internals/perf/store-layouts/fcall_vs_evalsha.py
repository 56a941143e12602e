# The shipped acquire.lua and release.lua (lua/), run as EVALSHA and as a function library (FCALL):
# what Functions would save per call. Usage: python3 fcall_vs_evalsha.py PORT
import valkey, sys, uuid, pathlib
port = int(sys.argv[1]); N = 20000
r = valkey.Valkey(port=port)
def cpu():
    i = r.info('cpu'); return i['used_cpu_user'] + i['used_cpu_sys']
L = pathlib.Path(__file__).resolve().parents[4] / 'lua'
lib = (L/'lib.lua').read_text().replace("string.rep('0', 240)", "'" + '0'*240 + "'")
acq = (L/'acquire.lua').read_text(); rel = (L/'release.lua').read_text()
r.flushall()
code = "#!lua name=tlproto\n" + lib + "\nredis.register_function('acquire', function(KEYS, ARGV)\n" + acq + "\nend)\nredis.register_function('release', function(KEYS, ARGV)\n" + rel + "\nend)\n"
r.execute_command('FUNCTION', 'LOAD', 'REPLACE', code)
a = r.script_load(lib + '\n' + acq); rl = r.script_load(lib + '\n' + rel)
for mode in ('evalsha', 'fcall', 'evalsha', 'fcall'):
    def A(p, *args):
        if mode == 'fcall': p.execute_command('FCALL', 'acquire', *args)
        else: p.execute_command('EVALSHA', a, *args)
    def R(p, *args):
        if mode == 'fcall': p.execute_command('FCALL', 'release', *args)
        else: p.execute_command('EVALSHA', rl, *args)
    ta = tr = 0
    for rnd in range(2):
        c0 = cpu(); p = r.pipeline(transaction=False)
        for i in range(N):
            b = f'tl:{{b/t{i}}}'; rid = uuid.uuid4().hex
            A(p, 5, b+':record', b+':fence', b+':req:'+rid, b+':lease', b+':grant', f'lease-{i}', f'o{i}', 30000, 0, 60000, rid)
        res = p.execute(); c1 = cpu()
        p = r.pipeline(transaction=False)
        for i in range(N):
            b = f'tl:{{b/t{i}}}'; rid = uuid.uuid4().hex
            R(p, 4, b+':record', b+':req:'+rid, b+':lease', b+':grant', f'lease-{i}', f'o{i}', res[i].split()[1], 60000)
        res2 = p.execute(); c2 = cpu()
        assert res2[0] == b'released', res2[0]
        if rnd: ta += (c1-c0)*1e6/N; tr += (c2-c1)*1e6/N
    print(f'{mode}: acquire {ta:6.2f} us, release {tr:6.2f} us')

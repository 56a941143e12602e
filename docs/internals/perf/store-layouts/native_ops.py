# The data operations of one acquire+release cycle as 12 native commands, pipelined, without Lua:
# what the key operations alone cost the server. Usage: python3 native_ops.py PORT
# The data operations of one acquire+release cycle as native commands, pipelined: the server
# cost of the key operations alone, without Lua (a lower bound for a native module command).
import valkey, sys, uuid
port = int(sys.argv[1]); N = 20000
r = valkey.Valkey(port=port)
def cpu():
    i = r.info('cpu'); return i['used_cpu_user'] + i['used_cpu_sys']
r.flushall()
for rnd in range(3):
    c0 = cpu(); p = r.pipeline(transaction=False)
    for i in range(N):
        b = f'tl:{{b/t{i}}}'; rid = uuid.uuid4().hex; rid2 = uuid.uuid4().hex
        p.execute_command('GET', b+':req:'+rid)
        p.execute_command('TIME')
        p.execute_command('HMGET', b+':record', 'record_version', 'lease_id', 'owner', 'token', 'acquired_ms', 'expires_ms', 'grant')
        p.execute_command('GET', b+':fence')
        p.execute_command('HSET', b+':record', 'lease_id', f'lease-{i}', 'owner', f'o{i}', 'token', '1796117611014000', 'acquired_ms', '1796117611014', 'expires_ms', '1796117641014', 'grant', rid)
        p.execute_command('SET', b+':fence', '1796117611014000')
        p.execute_command('SET', b+':req:'+rid, 'x'*40 + ' acquired 1796117611014000 30000 1796117611014 1796117611014', 'PX', 60000)
        p.execute_command('GET', b+':req:'+rid2)
        p.execute_command('TIME')
        p.execute_command('HMGET', b+':record', 'record_version', 'lease_id', 'owner', 'token', 'acquired_ms', 'expires_ms', 'grant')
        p.execute_command('HDEL', b+':record', 'lease_id', 'owner', 'token', 'acquired_ms', 'expires_ms')
        p.execute_command('SET', b+':req:'+rid2, 'x'*40 + ' released', 'PX', 60000)
        if i % 500 == 499:
            p.execute(); p = r.pipeline(transaction=False)
    p.execute()
    print(f'round {rnd}: {(cpu()-c0)*1e6/N:.2f} us of server CPU per cycle (12 native commands)')

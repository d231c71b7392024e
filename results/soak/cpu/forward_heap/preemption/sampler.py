"""Every 2 s: for each thread of the python processes (other than this one), CPU ms and context switches
(voluntary, involuntary) in the interval; the 6 busiest threads printed."""
import os, time, sys
def snap():
    out = {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit() or int(pid) == os.getpid(): continue
        try:
            cmd = open(f'/proc/{pid}/cmdline','rb').read().replace(b'\0', b' ').decode()[:60]
            if 'python' not in cmd: continue
            for tid in os.listdir(f'/proc/{pid}/task'):
                st = open(f'/proc/{pid}/task/{tid}/stat').read().rsplit(')',1)[1].split()
                cpu = int(st[11]) + int(st[12])
                v = nv = 0
                for line in open(f'/proc/{pid}/task/{tid}/status'):
                    if line.startswith('voluntary_ctxt_switches'): v = int(line.split()[1])
                    if line.startswith('nonvoluntary_ctxt_switches'): nv = int(line.split()[1])
                out[(pid, tid)] = (cpu, v, nv, cmd)
        except (FileNotFoundError, ProcessLookupError, PermissionError): pass
    return out
prev = snap(); t0 = time.time()
while time.time() - t0 < float(sys.argv[1]):
    time.sleep(2); cur = snap()
    rows = []
    for k, (cpu, v, nv, cmd) in cur.items():
        p = prev.get(k, (cpu, v, nv, cmd))
        rows.append(((cpu - p[0]) * 10 / 2, (v - p[1]) / 2, (nv - p[2]) / 2, k, cmd))
    rows.sort(reverse=True)
    print(f"t={time.time()-t0:5.0f}", " | ".join(f"{k[0]}/{k[1]} {c:.0f}ms/s v{v:.0f}/s nv{nv:.0f}/s" for c, v, nv, k, cmd in rows[:5]), flush=True)
    prev = cur

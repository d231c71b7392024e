"""The machine's busy cores and every busy process each second for SECONDS, from /proc (run beside the soak):
each process with its pid, parent pid and command, so the server's children (the engine process, then the
tenant processes, by start time) can be told apart.  python sample_load.py [SECONDS]"""
import os
import sys
import time

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
HZ = os.sysconf("SC_CLK_TCK")


def machine():
    v = list(map(int, open("/proc/stat").readline().split()[1:]))
    return sum(v), v[3] + v[4]


def procs():
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            s = open(f"/proc/{p}/stat").read()
            cmd = open(f"/proc/{p}/cmdline").read().replace("\0", " ")
        except OSError:
            continue
        f = s[s.rindex(")") + 2:].split()
        out[p] = (int(f[11]) + int(f[12]), int(f[1]), int(f[19]), cmd)  # CPU ticks, ppid, start time, command
    return out


prev, pp, t0 = machine(), procs(), time.time()
print(f"# clock ticks per second: {HZ}; columns: seconds, busy cores; then pid/ppid/start cores command")
while time.time() - t0 < SECONDS:
    time.sleep(1)
    cur, cp = machine(), procs()
    total = cur[0] - prev[0]
    busy = (total - (cur[1] - prev[1])) / total * os.cpu_count()
    rows = sorted(((cp[p][0] - pp.get(p, cp[p])[0], p) for p in cp), reverse=True)
    parts = [f"{p}/{cp[p][1]}/{cp[p][2]} {d / HZ:.2f} {cp[p][3][:50]}" for d, p in rows if d > 0][:8]
    print(f"{time.time() - t0:5.1f} {busy:.2f} | " + " | ".join(parts), flush=True)
    prev, pp = cur, cp

"""The machine's busy cores and the busiest processes every 2 s for 75 s, from /proc (run beside the soak)."""
import os
import time


def stat():
    v = list(map(int, open('/proc/stat').readline().split()[1:]))
    return sum(v), v[3] + v[4], v[7] if len(v) > 7 else 0


def procs():
    out = {}
    for p in os.listdir('/proc'):
        if not p.isdigit():
            continue
        try:
            s = open(f'/proc/{p}/stat').read()
            cmd = open(f'/proc/{p}/cmdline').read().replace('\0', ' ')[:80]
        except Exception:
            continue
        f = s[s.rindex(')') + 2:].split()
        out[p] = (int(f[11]) + int(f[12]), cmd)
    return out


prev, pp, t0 = stat(), procs(), time.time()
while time.time() - t0 < 75:
    time.sleep(2)
    cur, cp = stat(), procs()
    tot = cur[0] - prev[0]
    busy, steal = tot - (cur[1] - prev[1]), cur[2] - prev[2]
    top = sorted(((cp[p][0] - pp.get(p, (cp[p][0],))[0], cp[p][1]) for p in cp), reverse=True)[:5]
    print(f"{time.time() - t0:5.0f}s busy {busy / tot * 2:.2f} cores steal {steal / tot * 2:.2f} | "
          + " | ".join(f"{d / 200:.2f} {c[:60]}" for d, c in top if d > 0))
    prev, pp = cur, cp

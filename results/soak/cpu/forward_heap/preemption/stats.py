import json,gzip,sys,statistics as st
def q(v,p): v=sorted(v); return v[min(len(v)-1,int(p*len(v)))]
for run in sys.argv[1:]:
    try: d=json.load(gzip.open(run+'/cpu/probes.json.gz'))
    except Exception as e: print(run, e); continue
    for fl in d:
        P=d[fl]['probes']; Q=d[fl]['quiet_probes']
        row=[run, fl.split('/')[1], f"p95 {q([p['total_ms'] for p in Q],.95):.1f}->{q([p['total_ms'] for p in P],.95):.1f}"]
        for f in ['first_step_cpu_ms','last_step_cpu_ms','first_step_ms','submit_ms','after_ms']:
            row.append(f"{f[:-3]} {st.median([p[f] for p in Q]):.1f}->{st.median([p[f] for p in P]):.1f}")
        print(" ".join(row))

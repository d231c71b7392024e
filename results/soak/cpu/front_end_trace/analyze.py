"""Where the victim's probes spent their time in the front end, from one run's traces (python analyze.py RUN_DIR).

trace.jsonl.gz: one line per RPC message of the victim tenant, as the front end handled it (perf_counter
seconds): pre (the message read, before the gate), in (after the gate), done (the reply sent); for the poll
that got the final event also arr (the final arrived from the engine process), woke (the connection thread
woke with it) and regate (the thread back through the gate). client.jsonl.gz: each probe's start, submit
return and end at the client. The first half of the probes ran alone, the second under the flood."""
import gzip, json, numpy as np, sys
d=sys.argv[1]
srv=[json.loads(l) for l in gzip.open(d+'/trace.jsonl.gz', 'rt')]
cli=[json.loads(l) for l in gzip.open(d+'/client.jsonl.gz', 'rt')]
srv.sort(key=lambda r:r['pre'])
pres=np.array([r['pre'] for r in srv])
ms=lambda a,b:(b-a)*1e3
def analyze(probes,label):
    rows=[]
    for c in probes:
        i=np.searchsorted(pres,c['start']); j=np.searchsorted(pres,c['submitted'])
        subs=srv[i:j]
        fin=[r for r in srv if r.get('rid')==c['rid'] and r.get('type') in ('final','error')]
        if not subs or not fin: continue
        f=fin[0]
        gate=sum(ms(r['pre'],r['in']) for r in subs); call=sum(ms(r['in'],r['done']) for r in subs)
        rows.append(dict(total=ms(c['start'],c['end']), submit=ms(c['start'],c['submitted']), s_calls=len(subs), s_gate=gate, s_call=call,
          s_outside=ms(c['start'],c['submitted'])-gate-call, engine=ms(c['submitted'],f['arr']) if f.get('arr') else np.nan,
          f_wake=ms(f['arr'],f['woke']) if f.get('arr') else np.nan, f_regate=ms(f['woke'],f['regate']), f_send=ms(f['regate'],f['done']), f_back=ms(f['done'],c['end'])))
    keys=list(rows[0])
    tail=sorted(rows,key=lambda r:r['total'])[-len(rows)//10:]
    print(label,len(rows), 'p95', round(float(np.percentile([r['total'] for r in rows],95)),2))
    for name,rs in (('all',rows),('tail',tail)):
        print('  ',name,' '.join(f"{k}={np.nanmean([r[k] for r in rs]):.2f}" for k in keys))
n=len(cli)
analyze(cli[:n//2],'quiet'); analyze(cli[n//2:],'loaded')

#!/bin/bash
cd /work/main
for i in 1 2; do
  for f in true false; do
    s=$(date +%s)
    timeout 600 python -m vlora bench bench.suite=soak bench.out_dir=/tmp/soakab/r${i}_$f "bench.soak.server_overrides=['rpc.freeze_heap=$f']" > /tmp/soakab/r${i}_$f.log 2>&1
    echo "run $i freeze=$f rc=$? $(( $(date +%s) - s )) s $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done

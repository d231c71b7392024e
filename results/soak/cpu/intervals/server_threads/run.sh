#!/bin/bash
cd /work/main
for i in 1 2; do for t in 1 2; do
  timeout 700 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' bench.soak.server_threads=$t bench.out_dir=/tmp/cpu8/threads${t}_$i > /tmp/cpu8/threads${t}_$i.log 2>&1
  echo "threads$t run $i rc=$?" >> /tmp/cpu8/done.txt
done; done

#!/bin/bash
# a gap learned as at most 2x anticipate_ms (new, e61b3d8) against the plain moving average (old, 8f46544): floods on 2 CPU cores, alternated
R=${R:-/tmp/gap_ab}; mkdir -p $R
run() {  # name, tree
  s=$(date +%s)
  (cd $2 && PYTHONPATH=$2 timeout 200 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' bench.out_dir=$R/$1 > $R/$1.log 2>&1)
  echo "$1 rc=$? $(( $(date +%s) - s )) s $(date -u +%T)"; grep "fairness_" $R/$1.log | cut -c1-130
}
for i in 1 2 3; do run new_$i /work/main; run old_$i /tmp/before; done

#!/bin/bash
# quiet steps on (the default) against off (engine.tenant_quiet_prefill=false): the floods on 2 CPU cores, alternated
R=${R:-/tmp/quiet_ab}; mkdir -p $R
run() {  # name, quiet
  s=$(date +%s)
  PYTHONPATH=/work/main timeout 200 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' "bench.soak.server_overrides=[\"engine.tenant_quiet_prefill=$2\"]" bench.out_dir=$R/$1 > $R/$1.log 2>&1
  echo "$1 rc=$? $(( $(date +%s) - s )) s $(date -u +%T)"; grep "fairness_" $R/$1.log | cut -c1-130
}
for i in ${RUNS:-1 2 3}; do run on_$i true; run off_$i false; done

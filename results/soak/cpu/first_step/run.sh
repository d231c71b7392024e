#!/bin/bash
# the first-step rule on and off on 2 CPU cores, alternated: the floods
cd "$(dirname "$0")/.."
R=devscripts/cpu1; mkdir -p $R; cp devscripts/c1.sh $R/run.sh
{ nproc; lscpu | grep "Model name"; date -u; git log -1 --format=%h; } > $R/machine.txt 2>&1
for name in "$@"; do
  case $name in
    alone*) o="[]" ;;
    shared*) o='["engine.tenant_first_step_alone=false"]' ;;
  esac
  s=$(date +%s)
  timeout 400 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' "bench.soak.server_overrides=$o" bench.out_dir=$R/$name > $R/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - s )) s"; grep "fairness_" $R/$name.log | cut -c1-160
done

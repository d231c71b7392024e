#!/bin/bash
# the floods alone on this machine, quiet steps at rate 1 (b) and the defaults (a), alternated: b_1, a_1, then a_2, b_2
cd "$(dirname "$0")/../../../.."
mkdir -p /tmp/quiet_rate
for run in "$@"; do
  case $run in b_*) O='["engine.tenant_quiet_prefill=true","engine.tenant_quiet_rate=1"]' ;; *) O='[]' ;; esac
  python -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' "bench.soak.server_overrides=$O" \
    bench.out_dir=/tmp/quiet_rate/$run > /tmp/quiet_rate/$run.log 2>&1
done

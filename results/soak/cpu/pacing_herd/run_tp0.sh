#!/bin/bash
# one front end (rpc.tenant_processes=0) after the pacing fix
out=${1:-/tmp/pace/herd}; cd /work/main
for i in ${IDX:-1 2}; do
  date -u +%H:%M:%S > $out/tp0after_$i.start
  timeout 700 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' \
    'bench.soak.server_overrides=["rpc.tenant_processes=0"]' bench.out_dir=$out/tp0after_$i > $out/tp0after_$i.log 2>&1
done

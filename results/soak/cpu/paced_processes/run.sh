#!/bin/bash
# full floods, alternating one front end (tp0) and paced tenant processes (tp8p)
cd /work/main
out=${1:-/tmp/pace/ab}; mkdir -p $out
for i in ${IDX:-1 2 3}; do
  for servers in tp0:'["rpc.tenant_processes=0"]' tp8p:'["rpc.tenant_processes=8","rpc.pace_tenant_processes=true"]'; do
    name=${servers%%:*}; overrides=${servers#*:}
    date -u +%H:%M:%S > $out/${name}_$i.start
    timeout 700 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' \
      "bench.soak.server_overrides=$overrides" bench.out_dir=$out/${name}_$i > $out/${name}_$i.log 2>&1
  done
done
echo done > $out/DONE

#!/bin/bash
# full floods: paced tenant processes, not paced alone, at gate_share 0.5 and 0.25, alternated
cd /work/main
out=${1:-/tmp/pace/ab2}; mkdir -p $out
for i in ${IDX:-1 2 3}; do
  for servers in tp8pw:'["rpc.tenant_processes=8","rpc.pace_tenant_processes=true"]' \
                 tp8pw25:'["rpc.tenant_processes=8","rpc.pace_tenant_processes=true","rpc.gate_share=0.25"]'; do
    name=${servers%%:*}; overrides=${servers#*:}
    date -u +%H:%M:%S > $out/${name}_$i.start
    timeout 700 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' \
      "bench.soak.server_overrides=$overrides" bench.out_dir=$out/${name}_$i > $out/${name}_$i.log 2>&1
  done
done
echo done > $out/DONE

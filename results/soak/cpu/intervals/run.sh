#!/bin/bash
# the soak's floods on this 2-core machine, each server setting with the flood's client process at niceness 0 and 19
cd /work/main
for servers in tp0:'["rpc.tenant_processes=0"]' tp8:'["rpc.tenant_processes=8"]' \
               tp8n10:'["rpc.tenant_processes=8","rpc.tenant_process_nice=10"]'; do
  name=${servers%%:*}; overrides=${servers#*:}
  for n in 0 19; do
    timeout 700 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' \
      "bench.soak.server_overrides=$overrides" bench.soak.floods_client_nice=$n \
      bench.out_dir=/tmp/cpu5/${name}_nice$n > /tmp/cpu5/${name}_nice$n.log 2>&1
  done
done

#!/bin/bash
cd /work/main
for i in 1 2; do for sw in null 0.5; do
  timeout 700 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' "bench.soak.server_overrides=[\"rpc.switch_interval_ms=$sw\"]" bench.out_dir=/tmp/cpu7/sw${sw}_$i > /tmp/cpu7/sw${sw}_$i.log 2>&1
  echo "sw$sw run $i rc=$?" >> /tmp/cpu7/done.txt
done; done

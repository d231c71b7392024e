#!/bin/bash
cd /work/main
for r in 1 2; do for v in 0 8; do
  timeout 400 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' "bench.soak.server_overrides=[\"rpc.tenant_processes=$v\"]" bench.out_dir=/tmp/cpusoak/r${r}_tp$v > /tmp/cpusoak/r${r}_tp$v.log 2>&1
  echo "r$r tp=$v rc=$?" >> /tmp/cpusoak/done.txt
done; done
timeout 600 python -u -m vlora bench bench.suite=soak bench.out_dir=/tmp/cpusoak/full > /tmp/cpusoak/full.log 2>&1
echo "full rc=$?" >> /tmp/cpusoak/done.txt

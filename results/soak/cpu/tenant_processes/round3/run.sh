#!/bin/bash
cd /work/main
for r in 1; do for v in 0 8; do
  timeout 400 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' "bench.soak.server_overrides=[\"rpc.tenant_processes=$v\"]" bench.out_dir=/tmp/cpusoak3/r${r}_tp$v > /tmp/cpusoak3/r${r}_tp$v.log 2>&1
  echo "r$r tp=$v rc=$?" >> /tmp/cpusoak3/done.txt
done; done
timeout 600 python -u -m vlora bench bench.suite=soak bench.out_dir=/tmp/cpusoak3/full > /tmp/cpusoak3/full.log 2>&1
echo "full rc=$?" >> /tmp/cpusoak3/done.txt

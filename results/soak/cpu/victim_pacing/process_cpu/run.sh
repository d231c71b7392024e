#!/bin/bash
# alternated: the tree with rpc.pace_process_cpu on (default) and off, floods-only default floods
cd /work/main
for i in 1 2 3; do
  for set in on off; do
    if [ $set = off ]; then ovr='bench.soak.server_overrides=["rpc.pace_process_cpu=false"]'; else ovr='bench.soak.server_overrides=[]'; fi
    s=$(date +%s)
    timeout 600 python -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' "$ovr" bench.out_dir=/tmp/pc/${set}_$i > /tmp/pc/${set}_$i.log 2>&1
    echo "${set}_$i rc=$? $(( $(date +%s) - s )) s $(date -u +%H:%M)" >> /tmp/pc/progress.txt
  done
done

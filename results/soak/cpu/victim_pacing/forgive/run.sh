#!/bin/bash
# alternated: the tree before the change (b429156, /tmp/before) and after it (/work/main), floods-only default floods
for i in 1 2 3; do
  for set in after before; do
    if [ $set = before ]; then cd /tmp/before; else cd /work/main; fi
    s=$(date +%s)
    timeout 600 python -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' bench.out_dir=/tmp/pc2/${set}_$i > /tmp/pc2/${set}_$i.log 2>&1
    echo "${set}_$i rc=$? $(( $(date +%s) - s )) s $(date -u +%H:%M)" >> /tmp/pc2/progress.txt
  done
done

#!/bin/bash
# floods alone, the server's OpenMP threads 2 (torch's default on this machine) and 1 (the soak's setting), alternated
cd /tmp/before
for i in 1 2 3; do
  for t in 2 1; do
    PYTHONPATH=$PWD python -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' bench.soak.server_threads=$t bench.out_dir=/tmp/th/t${t}_$i > /tmp/th/t${t}_$i.log 2>&1
    echo "t$t $i $(grep -c yes$ /tmp/th/t${t}_$i.log)"; grep fairness_ /tmp/th/t${t}_$i.log | cut -c1-60
  done
done

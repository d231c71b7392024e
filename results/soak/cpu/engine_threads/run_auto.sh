#!/bin/bash
# floods alone, the server choosing its own threads (bench.soak.server_threads=null: rpc.engine_threads=auto gives
# the engine's process the usable cores less one, the other processes torch's default), this tree
cd /work/main
for i in 1 2 3; do
  python -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' bench.soak.server_threads=null bench.out_dir=/tmp/th/tauto_$i > /tmp/th/tauto_$i.log 2>&1
  echo "auto $i $(grep -c yes$ /tmp/th/tauto_$i.log)"; grep fairness_ /tmp/th/tauto_$i.log | cut -c1-60
done

#!/bin/bash
# floods alone, alternating the tree before (8850727, /tmp/before) and after (this working tree, /work/main)
for i in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then cd /tmp/before; else cd /work/main; fi
    PYTHONPATH=$PWD python -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' bench.out_dir=/tmp/ab/${side}_$i > /tmp/ab/${side}_$i.log 2>&1
    echo "$side $i $(grep -c yes$ /tmp/ab/${side}_$i.log)"; grep fairness_ /tmp/ab/${side}_$i.log | cut -c1-60
  done
done

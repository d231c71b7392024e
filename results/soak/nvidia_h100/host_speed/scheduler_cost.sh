#!/bin/bash
# plan + schedule host time, the tree before (devscripts/before (git archive 50be8db serve bench, the tree before 07c8d41)) and this one, alternated, on this host
cd "$(dirname "$0")/.."
S=$OUT/sc; mkdir -p $S; cp devscripts/sc.sh $S/run.sh
for r in 1 2 3; do
  for t in before after; do
    if [ $t = before ]; then P=$PWD/devscripts/before (git archive 50be8db serve bench, the tree before 07c8d41); else P=$PWD; fi
    (cd $P && PYTHONPATH=$P python -m bench.scheduler_cost --queues 8 32 256 2048 --windows 64 --policies fcfs v_lora --steps ${SC_STEPS:-300} --out $S/${t}_$r) > $S/${t}_$r.log 2>&1
    echo "$t $r"; grep -h "queue    32\|queue  2048" $S/${t}_$r.log
  done
done

#!/bin/bash
O=/tmp/alt/tok; mkdir -p $O
for i in 1 2 3; do
  for t in base notok; do
    d=/work/main; [ $t = notok ] && d=/tmp/notokens
    s=$(date +%s)
    (cd $d && PYTHONPATH=$d timeout 300 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' 'bench.soak.floods=[long]' bench.out_dir=$O/${t}_$i > $O/${t}_$i.log 2>&1)
    echo "${t}_$i rc=$? $(( $(date +%s) - s )) s $(grep fairness_long $O/${t}_$i.log | cut -c1-120)" >> $O/progress.txt
  done
done

#!/bin/bash
# alternate the tree before (9794ee6) and after (802e469): the default floods alone
O=/tmp/alt/out; mkdir -p $O
for pair in "before after" "after before" "before after"; do
  for t in $pair; do
    i=$(( $(ls -d $O/${t}_* 2>/dev/null | wc -l) + 1 ))
    d=/work/main; [ $t = before ] && d=/tmp/before
    s=$(date +%s)
    (cd $d && PYTHONPATH=$d timeout 400 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' bench.out_dir=$O/${t}_$i > $O/${t}_$i.log 2>&1)
    echo "${t}_$i rc=$? $(( $(date +%s) - s )) s $(date -u +%H:%M)" >> $O/progress.txt
  done
done

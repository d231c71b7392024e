#!/bin/bash
# the soak floods on this machine, A/B interleaved: new = the step cap's cached-prefix accounting (8a828e6), old = 1f768f9
for i in 1 2; do for t in new old; do
  if [ $t = new ]; then d=/work/main; else d=/tmp/cpubase; fi
  (cd $d && PYTHONPATH=$d timeout 700 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' bench.out_dir=/tmp/cpu9/${t}_$i > /tmp/cpu9/${t}_$i.log 2>&1)
  echo "$t run $i rc=$?" >> /tmp/cpu9/done.txt
done; done

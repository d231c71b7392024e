#!/bin/bash
cd /work/main
for i in 1 2; do for t in 2 1; do
  OMP_NUM_THREADS=$t timeout 700 python -u -m vlora bench bench.suite=soak '+bench.soak.phases=[floods]' bench.out_dir=/tmp/cpu6/omp${t}_$i > /tmp/cpu6/omp${t}_$i.log 2>&1
  echo "omp$t run $i rc=$?" >> /tmp/cpu6/done.txt
done; done

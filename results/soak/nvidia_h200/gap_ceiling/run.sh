#!/bin/bash
# a gap learned as at most 2x anticipate_ms (new) against the plain moving average (old): the floods, alternated (H200)
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R; cp devscripts/c3.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; lscpu | grep "Model name"; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
NEW=$PWD; OLD=/tmp/old; rm -rf $OLD; mkdir -p $OLD
tar cf - --exclude=./results --exclude=./.wheels . | tar xf - -C $OLD; cp devscripts/anticipation_old.py $OLD/serve/engine/anticipation.py
run() {  # name, tree
  s=$(date +%s)
  (cd $2 && PYTHONPATH=$2 timeout 140 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda '+bench.soak.phases=[floods]' bench.out_dir=$R/$1 > $R/$1.log 2>&1)
  echo "$1 rc=$? $(( $(date +%s) - s )) s"; grep "fairness_" $R/$1.log | cut -c1-160
}
for i in 1 2 3; do run new_$i $NEW; run old_$i $OLD; done

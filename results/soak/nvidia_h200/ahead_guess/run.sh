#!/bin/bash
# the soak floods, A/B interleaved: new = the step cap counts a cached prefix on neither side, the guess frees the slots of requests at their last token, ahead encoding stops once the device has finished the step; old = the tree before (HEAD)
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
NEW=$PWD; BASE=/tmp/base; rm -rf $BASE; mkdir -p $BASE; cp -r $NEW/. $BASE/; cp -r $NEW/devscripts/base/. $BASE/
R=$OUT/r; mkdir -p $R; cp devscripts/g3.sh $R/run.sh; echo "$COMMIT" > $R/commit.txt
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
run() {  # name, tree
  s=$(date +%s)
  (cd $2 && PYTHONPATH=$2 timeout 120 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda '+bench.soak.phases=[floods]' bench.out_dir=$R/$1 > $R/$1.log 2>&1)
  echo "$1 rc=$? $(( $(date +%s) - s )) s"; grep fairness_ $R/$1.log | cut -c1-150
}
run new_1 $NEW; run old_1 $BASE; run new_2 $NEW; run old_2 $BASE


#!/bin/bash
# the tree as it stands: the whole soak, then the floods twice (H200, defaults: 8 unpaced tenant processes)
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/c2.sh $R/run.sh; git rev-parse --short HEAD > $R/commit.txt 2>/dev/null
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; lscpu | grep "Model name"; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
s=$(date +%s)
timeout 280 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda bench.out_dir=$R/whole > $R/whole.log 2>&1
echo "whole rc=$? $(( $(date +%s) - s )) s"; grep "fairness_\|missed\|rss\|RSS" $R/whole.log | cut -c1-160
run() {  # name, overrides list
  s=$(date +%s)
  timeout 150 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda '+bench.soak.phases=[floods]' "bench.soak.server_overrides=$2" bench.out_dir=$R/$1 > $R/$1.log 2>&1
  echo "$1 rc=$? $(( $(date +%s) - s )) s"; grep "fairness_" $R/$1.log | cut -c1-160
}
run floods_1 "[]"
run floods_2 "[]"
cd $OUT && tar czf r.tgz r && rm -rf r

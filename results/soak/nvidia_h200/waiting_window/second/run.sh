#!/bin/bash
# the waiting window, second call: the whole soak (every attack phase, the floods, the leak checks), then the floods alone once more
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/w2.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; lscpu | grep "Model name"; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
s=$(date +%s)
timeout 300 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda bench.out_dir=$R/whole > $R/whole.log 2>&1
echo "whole rc=$? $(( $(date +%s) - s )) s"; grep -E "NO$|missed|passed|fairness_|lockout|rss" $R/whole.log | cut -c1-170 | tail -30
s=$(date +%s)
timeout 170 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda '+bench.soak.phases=[floods]' 'bench.soak.server_overrides=[]' bench.out_dir=$R/window_3 > $R/window_3.log 2>&1
echo "window_3 rc=$? $(( $(date +%s) - s )) s"; grep "fairness_" $R/window_3.log | cut -c1-160
cd $OUT && tar czf r.tgz r && rm -rf r

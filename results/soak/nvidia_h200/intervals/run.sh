#!/bin/bash
# the soak's floods on the GPU: 200 probes a flood with a bootstrap interval; front-end processes auto (8 on 16 cores) twice, none once
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/g1.sh $R/run.sh; echo "$COMMIT" > $R/commit.txt
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
run() {  # name, overrides list
  s=$(date +%s)
  timeout 170 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda '+bench.soak.phases=[floods]' "bench.soak.server_overrides=$2" bench.out_dir=$R/$1 > $R/$1.log 2>&1
  echo "$1 rc=$? $(( $(date +%s) - s )) s"; grep fairness_ $R/$1.log | cut -c1-160
}
run floods_auto_1 '[]'
run floods_tp0 '["rpc.tenant_processes=0"]'
run floods_auto_2 '[]'
cd $OUT && tar czf r.tgz r && rm -rf r

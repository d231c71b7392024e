#!/bin/bash
# step parts per probe (steps, step ms, intake, graphs); the engine process's switch interval 0.25 ms against 5, alternated
cd "$(dirname "$0")/.."
python -m pip install --no-deps --no-index -q .wheels/antlr4*.whl .wheels/hydra*.whl .wheels/omegaconf*.whl .wheels/plumbum*.whl .wheels/rpyc*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R; cp devscripts/a5.sh $R/run.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; lscpu | grep "Model name"; python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; date -u; } > $R/machine.txt 2>&1
run() {  # name, overrides list
  s=$(date +%s)
  timeout 150 python -u -m vlora bench bench.suite=soak bench.soak.device=cuda '+bench.soak.phases=[floods]' "bench.soak.server_overrides=$2" bench.out_dir=$R/$1 > $R/$1.log 2>&1
  echo "$1 rc=$? $(( $(date +%s) - s )) s"; grep "fairness_" $R/$1.log | cut -c1-160
}
run base_1 "[]"
run sw025_1 '["rpc.engine_switch_interval_ms=0.25"]'
run base_2 "[]"
run sw025_2 '["rpc.engine_switch_interval_ms=0.25"]'
cd $OUT && tar czf r.tgz r && rm -rf r
